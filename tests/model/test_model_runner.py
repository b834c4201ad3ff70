"""ModelRunner steps that the scheduler produces besides plain prefill/decode: chunked prefill
(a middle chunk samples nothing, the next attends over the cached prefix) and mixed batches
(decode rows and prefill rows together). Each must give the logits of the simple path."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_runner import ModelRunner

from conftest import make_tiny_checkpoint  # noqa: E402

torch.set_num_threads(1)
PAGE = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_tiny_checkpoint("llama", path)
    return ModelRunner(EngineConfig(model_path=path, dtype="float32", max_total_tokens=512, page_size=PAGE))


def step(runner, seqs, sample):
    """seqs: list of (pages, prefix_len, new token ids); sample[i]: whether seq i's last row gets logits."""
    ids, pos, loc, logits_rows = [], [], [], []
    width = max(len(p) for p, _, _ in seqs)
    page_table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (pages, prefix, new) in enumerate(seqs):
        page_table[i, : len(pages)] = torch.tensor(pages)
        for j, t in enumerate(new):
            p = prefix + j
            ids.append(t)
            pos.append(p)
            loc.append(pages[p // PAGE] * PAGE + p % PAGE)
        if sample[i]:
            logits_rows.append(len(ids) - 1)
    return runner.forward(ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), out_cache_loc=torch.tensor(loc),
        page_table=page_table, logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        extend_lens=[len(n) for _, _, n in seqs], seq_lens=[pre + len(n) for _, pre, n in seqs],
    ))


def test_chunked_prefill_and_mixed_batch_give_the_simple_path_logits(runner):
    pool = runner.page_pool
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 512, (37,), generator=gen).tolist()
    other = torch.randint(3, 512, (11,), generator=gen).tolist()

    a = pool.alloc(pool.pages_for(40))
    whole = step(runner, [(a, 0, prompt)], [True])[0]  # one prefill
    nxt = int(whole.argmax())
    after = step(runner, [(a, 37, [nxt])], [True])[0]  # one decode
    alone = step(runner, [(pool.alloc(pool.pages_for(11)), 0, other)], [True])[0]

    b = pool.alloc(pool.pages_for(40))
    middle = step(runner, [(b, 0, prompt[:22])], [False])  # first chunk samples nothing
    assert middle.shape == (0, runner.arch.vocab_size)
    chunked = step(runner, [(b, 22, prompt[22:])], [True])[0]  # second chunk over a 22-token prefix
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)

    c = pool.alloc(pool.pages_for(11))
    mixed = step(runner, [(b, 37, [nxt]), (c, 0, other)], [True, True])  # decode row + prefill rows
    torch.testing.assert_close(mixed[0], after, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1], alone, atol=1e-4, rtol=1e-4)
    assert int(after.argmax()) == int(mixed[0].argmax())
