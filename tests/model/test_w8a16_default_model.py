"""w8a16 and w8a8 on the default model (SmolLM2-135M-Instruct) against its bf16: greedy agreement on
16 chat prompts, decoded 4 at a time so their steps take the int8 gemv path where it is available
(w8a8 differs from w8a16 in the prefill of each 4), and perplexity on a fixed text, prefilled in
one step (w8a16: the dequantized path; w8a8: per-token int8 activations, their outliers exact)."""

from __future__ import annotations

import pytest
import torch
from support.model_util import greedy_generate

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.layers import GEMV_MAX_ROWS

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three uses of copper.", "Hi", "What is 12 times 7?", "Name a famous painter.", "How do birds fly?",
    "Give me a synonym for happy.", "Why is the sky blue?", "Translate 'good morning' to Spanish.",
    "What does a CPU do?", "Suggest a name for a cat.", "How many legs does a spider have?",
    "What is the boiling point of water?", "Describe a rainbow.",
]
# four paragraphs (522 tokens): on the first alone (170) perplexity moved by 1-4% when any one of
# w8a8's linears was made more precise, too noisy to hold a 2% bar to
TEXT = "\n".join([
    (
        'The river rose slowly through the night, and by morning the low fields near the village were under '
        'water. Farmers moved their animals to the hills, while children watched from the bridge as branches '
        'and boxes floated past. The mayor called a meeting in the school hall. Everyone agreed that the old '
        'wall along the bank had to be repaired before the spring rains, but nobody knew where the money would '
        'come from. After a long discussion, the baker offered to sell bread at the market every Saturday and '
        'give the profit to the repair fund. Others followed with their own ideas: a concert, a football match, '
        'and a book sale. By the end of the summer the village had raised enough to buy stone and hire two '
        'masons from the city.'
    ),
    (
        'The masons arrived in September with a cart full of tools. They walked the length of the wall with the '
        'mayor, tapping the old stones with small hammers and writing numbers in a notebook. In some places the '
        'mortar had turned to sand, and in others the roots of willow trees had pushed the stones apart. The '
        'older mason said that the worst part, near the mill, would have to be taken down and built again from '
        'the ground. The work would take six weeks if the weather stayed dry. The villagers offered to help, '
        'and every morning a few of them came down to the river to carry stones, mix lime, and bring water.'
    ),
    (
        'Not everyone was pleased. The miller complained that the scaffolding blocked the path to his door, and '
        'the fishermen said the noise frightened the fish. The schoolteacher, on the other hand, brought her '
        'class to watch the masons at work. The children learned how a wall is built in layers, why the stones '
        'at the bottom are the largest, and how the mortar must be kept wet while it sets. One boy asked why '
        'the new wall was thicker at the base than at the top, and the mason explained that the river pushes '
        'hardest where the water is deepest.'
    ),
    (
        'In October the rain returned. For three days it fell without stopping, and the river rose again, '
        'higher than it had been in the spring. People gathered on the bridge to watch, holding umbrellas and '
        'lanterns. The water climbed the new stones one row at a time, but it did not pass the top, and the '
        'fields behind the wall stayed dry. When the rain finally stopped, the mayor walked along the bank and '
        'counted the places where the water had found its way through. There were none. That evening the baker '
        'gave away the last of the Saturday bread, and the whole village ate together in the school hall.'
    ),
])
NEW_TOKENS = 32
AGREEMENT_BOUND = 0.9  # the issue's, for both


@pytest.fixture(scope="module")
def runners():
    torch.set_num_threads(2)
    return {q: ModelRunner(EngineConfig(dtype="bfloat16", max_total_tokens=4096, quantization=q))
            for q in ("none", "w8a16", "w8a8")}


@pytest.mark.parametrize("quant", ["w8a16", "w8a8"])
def test_greedy_agrees_with_bf16_up_to_first_divergence(runners, quant):
    tok = runners["none"].tokenizer
    prompts = [
        tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False).input_ids
        for q in QUESTIONS
    ]
    outs = {}
    for q in ("none", quant):
        outs[q] = [t for i in range(0, len(prompts), GEMV_MAX_ROWS)
                   for t in greedy_generate(runners[q], prompts[i : i + GEMV_MAX_ROWS], NEW_TOKENS)[0]]
    same = total = 0
    for a, b in zip(outs["none"], outs[quant]):
        for x, y in zip(a, b):
            total += 1
            same += x == y
            if x != y:
                break  # past the first divergence the two continue different texts
    # measured w8a16 0.93 (Emerald Rapids, 200 / 215); w8a8 173 / 188 = 0.92 with its activation
    # outliers exact (without: 0.94 on Zen 4, 0.89 on Zen 1 with AVX2's gemv)
    assert same / total >= AGREEMENT_BOUND, (quant, same, total)
    if quant == "w8a16":
        # the first token of this answer is a bf16 near-tie ("The" 25.75, "L" 25.5: 0.07 of the
        # logits' std); w8a8 without its outliers reversed it and answered "L'Étoile ...", with
        # them it keeps "Paris" here, too near a tie to hold it to
        assert "Paris" in tok.decode(outs[quant][0])


def perplexity(runner, ids: list[int]) -> float:
    pool = runner.page_pool
    n, ps = len(ids), pool.page_size
    pages = pool.alloc(pool.pages_for(n))
    try:
        table = torch.tensor([pages], dtype=torch.int32)
        slots = (table.long()[:, :, None] * ps + torch.arange(ps)).reshape(-1)[:n]
        logits = runner.forward(ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(n), out_cache_loc=slots, page_table=table,
            logits_indices=torch.arange(n), extend_lens=[n], seq_lens=[n],
        ))
    finally:
        pool.free(pages)
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp())


# The bar: 2% over bf16. Measured on TEXT: Zen 4, fp32 21.81, bf16 21.70 (the native panel
# products; 21.82 through oneDNN's), w8a16 21.94 (+1.1%), w8a8 without its outliers 22.95 (+5.8%);
# Emerald Rapids, bf16 21.85, w8a16 21.94 (+0.4%), w8a8 22.06 (+0.95%; +5.0% without outliers).
PERPLEXITY_BOUND = 1.02


@pytest.mark.parametrize("quant", ["w8a16", "w8a8"])
def test_perplexity_over_bf16_within_bound(runners, quant):
    ids = runners["none"].tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > 500
    bf16, w8 = perplexity(runners["none"], ids), perplexity(runners[quant], ids)
    assert w8 <= PERPLEXITY_BOUND * bf16, (quant, bf16, w8)
    assert w8 != bf16  # the int8 weights are in use
