"""Batched sampling ops against direct per-row definitions."""

from __future__ import annotations

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.sampling import (
    SamplingTensors,
    apply_penalties,
    filter_sorted_probs,
    gather_logprobs,
    renorm_probs,
    sample,
    seeded_uniform,
)

V = 10


def tensors(*params):
    return SamplingTensors.from_params(list(params), V)


def test_top_k_top_p_min_p_masks():
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * 5] * 4)
    top_ks = torch.tensor([2, V, V, V])
    top_ps = torch.tensor([1.0, 0.7, 0.71, 1.0])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.3])  # 0.3 * 0.4 = 0.12
    kept = filter_sorted_probs(probs, top_ks, top_ps, min_ps) > 0
    assert kept[0, :5].tolist() == [True, True, False, False, False]
    assert kept[1, :5].tolist() == [True, True, False, False, False]  # 0.4 + 0.3 reaches 0.7
    assert kept[2, :5].tolist() == [True, True, True, False, False]
    assert kept[3, :5].tolist() == [True, True, True, False, False]
    # unsorted input: renorm_probs keeps vocabulary order and sums to one
    perm = torch.randperm(V)
    out = renorm_probs(probs[:1, perm], top_ks[:1], top_ps[:1], min_ps[:1])
    assert torch.allclose(out.sum(-1), torch.ones(1))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(V)
    assert torch.allclose(out[0, inv][:2], torch.tensor([0.4, 0.3]) / 0.7)


def test_greedy_fast_path_and_greedy_rows():
    logits = torch.randn(3, V)
    t = tensors(SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0))
    assert t.all_greedy
    assert sample(logits, t, None).tolist() == logits.argmax(-1).tolist()
    t = tensors(SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))
    out = sample(logits[:2], t, torch.tensor([0.99, 0.5]))
    assert out[0] == logits[0].argmax()


def test_sampled_tokens_follow_distribution_and_filters():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    n = 4000
    t = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * n, V)
    ids = sample(logits.expand(n, V), t, torch.rand(n))
    freq = torch.bincount(ids, minlength=V).float() / n
    assert abs(freq[0] - 0.5) < 0.04 and abs(freq[1] - 0.3) < 0.04 and abs(freq[2] - 0.2) < 0.04
    t = SamplingTensors.from_params([SamplingParams(top_k=2)] * n, V)
    ids = sample(logits.expand(n, V), t, torch.rand(n))
    assert set(ids.tolist()) == {0, 1}
    # low temperature sharpens towards the argmax
    t = SamplingTensors.from_params([SamplingParams(temperature=0.1)] * n, V)
    ids = sample(logits.expand(n, V), t, torch.rand(n))
    assert (ids == 0).float().mean() > 0.95


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 1, 3)]
    t = tensors(*params)
    u = torch.tensor([seeded_uniform(p.seed, 0) for p in params])
    a = sample(logits, t, u)
    b = sample(logits, t, u)
    assert a.tolist() == b.tolist()
    alone = sample(logits[2:3], tensors(params[2]), u[2:3])
    assert alone.item() == a[2].item()
    assert seeded_uniform(1, 0) == seeded_uniform(1, 0) != seeded_uniform(1, 1)
    draws = {seeded_uniform(s, 0) for s in range(50)}
    assert len(draws) == 50


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)] * 3)
    t = tensors(
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=0.5),
    )
    assert t.need_penalties
    prompt = [[0, 1], [0], [0]]
    output = [[], [2, 2, 3], [2, 2, 3]]
    out = apply_penalties(logits, prompt, output, t)
    assert out[0, :4].tolist() == [1.0, -4.0, 1.0, 0.5]  # prompt tokens penalized, sign-aware
    assert out[1, :4].tolist() == [2.0, -2.0, 0.0, 0.0]  # 1 - 0.5*2, 0.5 - 0.5*1
    assert out[2, :4].tolist() == [2.0, -2.0, 0.5, 0.0]
    assert not tensors(SamplingParams()).need_penalties


def test_logprobs_and_top_logprobs():
    logits = torch.randn(2, V)
    ids = torch.tensor([3, 7])
    chosen, tops = gather_logprobs(logits, ids, 3)
    ref = torch.log_softmax(logits, -1)
    assert abs(chosen[0] - ref[0, 3].item()) < 1e-6 and abs(chosen[1] - ref[1, 7].item()) < 1e-6
    assert [t[0] for t in tops[0]] == ref[0].topk(3).indices.tolist()
    assert tops[0][0][1] >= tops[0][1][1] >= tops[0][2][1]


def _reference_sample(logits, params, uniforms):
    """Full-sort filtering and inverse CDF, row by row."""
    out = []
    for row, p, u in zip(logits, params, uniforms.tolist()):
        if p.temperature == 0.0 or p.top_k == 1:
            out.append(int(row.argmax()))
            continue
        probs = torch.softmax(row / p.temperature, -1)
        if p.top_k < 0 and p.top_p == 1.0 and p.min_p == 0.0:  # unfiltered: vocabulary order
            cdf = probs.cumsum(0)
            out.append(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True)))
            continue
        vals, idx = probs.sort(descending=True)
        k = row.numel() if p.top_k < 0 else p.top_k
        kept = filter_sorted_probs(vals[None], torch.tensor([k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]
        cdf = kept.cumsum(0)
        pos = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True).clamp(max=row.numel() - 1))
        out.append(int(idx[pos]))
    return out


def test_candidate_shortcut_matches_full_sort():
    torch.manual_seed(1)
    vocab = 5000
    sharp = torch.randn(8, vocab) * 4  # mass concentrated: the top-256 view is exact
    flat = torch.randn(8, vocab) * 0.01  # near-uniform: top_p needs the full sort fallback
    logits = torch.cat([sharp, flat])
    variants = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=1000, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.99, min_p=0.001),
        SamplingParams(temperature=1.0, top_k=300),
    ]
    params = variants * 2
    t = SamplingTensors.from_params(params, vocab)
    for trial in range(5):
        u = torch.rand(len(params))
        assert sample(logits, t, u).tolist() == _reference_sample(logits, params, u)
