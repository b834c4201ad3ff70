"""Model helpers shared by test folders: a greedy loop over ModelRunner that allocates pages itself,
as the scheduler would, transformers' greedy generate, and tiny random checkpoints."""

from __future__ import annotations

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch


def bf16_runner(path: str, **kw):
    """A bf16 ModelRunner of a small pool (pages of 4 tokens: short prompts cross pages), engine flags ``kw``."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_executor.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model_path=path, dtype="bfloat16", max_total_tokens=2048, page_size=4, **kw))


def random_prompts(lens: list[int], seed: int) -> list[list[int]]:
    """Prompts of these lengths, seeded, within the tiny checkpoints' vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lens]


def greedy_generate(runner, prompts: list[list[int]], max_new: int, forced: list[list[int]] | None = None,
                    lora_slots: list[int] | None = None):
    """Prefill all prompts in one ragged batch, then decode them together.

    Returns (tokens, logits): tokens[i] are sequence i's argmax picks, logits[i] its
    [max_new, vocab] logits. With ``forced``, sequence i is fed forced[i][t] at step t
    instead of its own pick (teacher forcing), so its logits follow another model's path.
    ``lora_slots``: sequence i's LoRA slot in the runner (-1: none), for every step.
    """
    pool = runner.page_pool
    ps = pool.page_size
    bs = len(prompts)
    pages = [pool.alloc(pool.pages_for(len(p) + max_new)) for p in prompts]
    width = max(len(p) for p in pages)
    page_table = torch.zeros(bs, width, dtype=torch.int32)
    for i, p in enumerate(pages):
        page_table[i, : len(p)] = torch.tensor(p)

    def slot(i: int, pos: int) -> int:
        return pages[i][pos // ps] * ps + pos % ps

    tokens = [[] for _ in range(bs)]
    logits = [[] for _ in range(bs)]
    try:
        lens = [len(p) for p in prompts]
        ends = torch.tensor(lens).cumsum(0) - 1
        batch = ForwardBatch(
            input_ids=torch.tensor([t for p in prompts for t in p]),
            positions=torch.cat([torch.arange(n) for n in lens]),
            out_cache_loc=torch.tensor([slot(i, j) for i, n in enumerate(lens) for j in range(n)]),
            page_table=page_table,
            logits_indices=ends,
            extend_lens=list(lens),
            seq_lens=list(lens),
            lora_slots=None if lora_slots is None else torch.tensor(lora_slots).repeat_interleave(torch.tensor(lens)),
        )
        for step in range(max_new):
            out = runner.forward(batch)
            assert out.shape == (bs, runner.arch.vocab_size) and out.dtype == torch.float32
            feed = []
            for i in range(bs):
                tokens[i].append(int(out[i].argmax()))
                logits[i].append(out[i])
                feed.append(forced[i][step] if forced else tokens[i][-1])
            positions = [n + step for n in lens]
            batch = ForwardBatch(
                input_ids=torch.tensor(feed),
                positions=torch.tensor(positions),
                out_cache_loc=torch.tensor([slot(i, p) for i, p in enumerate(positions)]),
                page_table=page_table,
                logits_indices=torch.arange(bs),
                extend_lens=[1] * bs,
                seq_lens=[p + 1 for p in positions],
                lora_slots=None if lora_slots is None else torch.tensor(lora_slots),
            )
    finally:
        for p in pages:
            pool.free(p)
        pool.check_integrity()
    return tokens, [torch.stack(x) for x in logits]


def assert_picks_agree_but_near_ties(tokens: list[list[int]], want: list[list[int]], logits: list[torch.Tensor],
                                     frac: float = 0.05) -> None:
    """Greedy picks ``tokens`` agree with ``want`` wherever the top two of ``want``'s ``logits``
    ([steps, vocab] per sequence) are more than ``frac`` of the logits' std apart."""
    for seq, seq_want, seq_logits in zip(tokens, want, logits):
        for t, (a, b) in enumerate(zip(seq, seq_want)):
            if a != b:
                top2 = seq_logits[t].topk(2).values
                assert top2[0] - top2[1] < frac * seq_logits[t].std(), (t, a, b)


def hf_greedy(model, prompt: list[int], max_new: int):
    """transformers greedy generate, never stopping early: (tokens, [max_new, vocab] logits)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def make_tiny_checkpoint(kind: str, path: str) -> None:
    """A small random transformers checkpoint with a word-level tokenizer: qwen2, qwen3, llama,
    qwen3_moe (8 experts, top 3, renormalized) or gemma3 (tied embeddings, sliding window of 8 in
    layers 0 and 2, query_pre_attn_scalar off head_dim, global rope linearly scaled, final logits
    soft-capped)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                              PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=10000.0, **common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=32, rope_theta=1000000.0, num_experts=8,
                                                   num_experts_per_tok=3, moe_intermediate_size=48,
                                                   norm_topk_prob=True, **common))
    elif kind == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, final_logit_softcapping=20.0, rope_parameters=rope, pad_token_id=0,
            **{**common, "tie_word_embeddings": True}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, rope_theta=1000000.0, **common))
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1 (Gemma's to 0): make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(0.0 if kind == "gemma3" else 1.0, 0.3)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    elif kind in ("qwen3", "qwen3_moe", "gemma3"):
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(path)


def hf_model(path: str):
    """transformers' own model of a checkpoint directory, float32, for reference runs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_q8_0_gguf(src: str, dst: str) -> None:
    """A copy of GGUF file ``src`` at ``dst`` with every 2-D weight whose rows are whole 32-value
    blocks stored as Q8_0 (quantized from its dequantized values by gguf's reference code), the
    rest float32, and the metadata (tokenizer included) as it was."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for t in reader.tensors:
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if values.ndim == 2 and values.shape[1] % 32 == 0:
            writer.add_tensor(t.name, quantize(values, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
