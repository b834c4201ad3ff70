"""Batched sampling ops: penalties, temperature, top-k / top-p / min-p, logprobs.

Every op works on a whole batch of rows at once, each row with its own
parameters. Sampling is inverse-CDF with one uniform number per row, given by
the caller: a request with a seed draws it from ``seeded_uniform(seed, step)``,
so its tokens do not depend on which other requests share the batch.

Shapes: ``logits`` / ``probs`` are ``[bs, vocab]`` float32; per-row parameters
are ``[bs]``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.kernels.cpu_native import native_kernels


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, ``[bs]`` int64: natively for float32 on CPU (``cpu_argmax.c``, the
    same answer 3-4x faster at 64 x 49152), else torch's."""
    native = native_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if native is None or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return logits.argmax(-1)
    return native.argmax(logits)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): the draw of a seeded request."""
    return random.Random(f"{seed}:{step}").random()


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [bs] float32, 1.0 for greedy rows
    top_ks: torch.Tensor  # [bs] int64, vocab size where off
    top_ps: torch.Tensor  # [bs] float32
    min_ps: torch.Tensor  # [bs] float32
    greedy: torch.Tensor  # [bs] bool
    repetition_penalties: torch.Tensor  # [bs] float32
    frequency_penalties: torch.Tensor  # [bs] float32
    presence_penalties: torch.Tensor  # [bs] float32
    all_greedy: bool
    need_filter: bool  # some row uses top_k, top_p or min_p
    need_penalties: bool

    @classmethod
    def from_params(cls, params: Sequence, vocab_size: int, device="cpu") -> "SamplingTensors":
        """``params``: objects with SamplingParams' fields, one per row."""
        greedy = [p.temperature == 0.0 or p.top_k == 1 for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [vocab_size if (p.top_k < 0 or p.top_k > vocab_size) else p.top_k for p in params]
        f32 = dict(dtype=torch.float32, device=device)
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        return cls(
            temperatures=torch.tensor(temps, **f32),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor([p.top_p for p in params], **f32),
            min_ps=torch.tensor([p.min_p for p in params], **f32),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            repetition_penalties=torch.tensor(rep, **f32),
            frequency_penalties=torch.tensor(freq, **f32),
            presence_penalties=torch.tensor(pres, **f32),
            all_greedy=all(greedy),
            need_filter=any(p.top_k not in (-1, vocab_size) or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
            need_penalties=any(r != 1.0 for r in rep) or any(freq) or any(pres),
        )


def _count_tokens(token_ids: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """``[bs, vocab]`` float32 occurrence counts of each row's ids."""
    bs = len(token_ids)
    width = max((len(t) for t in token_ids), default=0)
    counts = torch.zeros(bs, vocab_size + 1, dtype=torch.float32, device=device)
    if width:
        # pad with an extra column ``vocab_size`` that is dropped afterwards
        ids = torch.full((bs, width), vocab_size, dtype=torch.int64)
        for i, t in enumerate(token_ids):
            if t:
                ids[i, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
        counts.scatter_add_(1, ids.to(device), torch.ones(bs, width, device=device))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    t: SamplingTensors,
) -> torch.Tensor:
    """SGLang/OpenAI semantics, out of place.

    repetition: tokens seen in prompt or output have positive logits divided and
    negative ones multiplied by the penalty; frequency / presence: subtract
    ``penalty * count`` / ``penalty * (count > 0)`` over output tokens.
    """
    # logits: [bs, vocab]
    bs, vocab = logits.shape
    out_counts = _count_tokens(output_ids, vocab, logits.device)  # [bs, vocab]
    logits = logits - t.frequency_penalties[:, None] * out_counts
    logits = logits - t.presence_penalties[:, None] * (out_counts > 0).float()
    if (t.repetition_penalties != 1.0).any():
        seen = (out_counts + _count_tokens(prompt_ids, vocab, logits.device)) > 0  # [bs, vocab]
        rp = t.repetition_penalties[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    return logits


def filter_sorted_probs(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Zero what top-k, top-p and min-p exclude; rows sorted descending. Not renormalized.

    top-p keeps the smallest head whose mass reaches ``top_p`` (the first token always
    stays); min-p drops tokens below ``min_p`` times the top probability.
    """
    # sorted_probs: [bs, vocab] descending per row
    vocab = sorted_probs.shape[-1]
    ranks = torch.arange(vocab, device=sorted_probs.device)[None, :]  # [1, vocab]
    drop = ranks >= top_ks[:, None]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= mass_before > top_ps[:, None]
    drop |= sorted_probs < min_ps[:, None] * sorted_probs[:, :1]
    return sorted_probs.masked_fill(drop, 0.0)


def renorm_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """``probs`` after top-k / top-p / min-p, renormalized, in vocabulary order."""
    sorted_probs, idx = probs.sort(-1, descending=True)
    kept = filter_sorted_probs(sorted_probs, top_ks, top_ps, min_ps)
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, idx, kept)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first column whose cumulative mass exceeds ``u * total`` (zero-mass columns never chosen)."""
    cdf = probs.cumsum(-1)  # [bs, vocab]
    target = (uniforms * cdf[:, -1]).unsqueeze(1)  # [bs, 1]
    pos = torch.searchsorted(cdf, target, right=True)
    return pos.clamp_(max=probs.shape[-1] - 1).squeeze(1)


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Logits divided by each row's temperature (greedy rows unchanged)."""
    if t.all_greedy:
        return logits
    return logits / t.temperatures[:, None]


# candidates examined before falling back to a full sort (a full-vocabulary sort costs ~30 top-k's)
TOPK_CANDIDATES = 256


def _filtered_ids(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Sample under top-k / top-p / min-p, looking only at the top candidates where that is exact.

    The filters keep a head of the sorted distribution. If the last of the K
    candidates is already cut (by top_k <= K, by the head's mass passing top_p,
    or by min_p), everything past it is cut too, so the top-K view is exact;
    rows where it is not are sorted in full.
    """
    # probs: [n, vocab]
    vocab = probs.shape[-1]
    k = min(vocab, max(TOPK_CANDIDATES, int(top_ks[top_ks < vocab].max()) if (top_ks < vocab).any() else 0))
    vals, idx = probs.topk(k, dim=-1)  # [n, k] descending
    exact = (top_ks <= k) | (vals.sum(-1) > top_ps) | (vals[:, -1] < min_ps * vals[:, 0])
    if not bool(exact.all()):
        rows = (~exact).nonzero().squeeze(1)
        full_vals, full_idx = probs[rows].sort(-1, descending=True)
        pad = vocab - k
        vals = torch.nn.functional.pad(vals, (0, pad))  # zero mass past the candidates
        idx = torch.nn.functional.pad(idx, (0, pad))
        vals[rows], idx[rows] = full_vals, full_idx
    kept = filter_sorted_probs(vals, top_ks, top_ps, min_ps)
    return idx.gather(1, _inverse_cdf(kept, uniforms).unsqueeze(1)).squeeze(1)


def sample(logits: torch.Tensor, t: SamplingTensors, uniforms: torch.Tensor | None) -> torch.Tensor:
    """``[bs]`` int64 token ids. ``logits`` already penalized; ``uniforms`` ``[bs]`` in [0, 1)."""
    # logits: [bs, vocab] float32
    greedy = greedy_ids(logits)
    if t.all_greedy:
        return greedy
    probs = torch.softmax(processed_logits(logits, t), dim=-1)  # [bs, vocab]
    ids = _inverse_cdf(probs, uniforms)
    if t.need_filter:
        vocab = probs.shape[-1]
        rows = ((t.top_ks < vocab) | (t.top_ps < 1.0) | (t.min_ps > 0.0)).nonzero().squeeze(1)
        ids[rows] = _filtered_ids(probs[rows], t.top_ks[rows], t.top_ps[rows], t.min_ps[rows], uniforms[rows])
    return torch.where(t.greedy, greedy, ids)


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Logprob of each row's chosen token and its ``top_n`` most likely (id, logprob) pairs."""
    # logits: [bs, vocab] (after penalties and temperature); token_ids: [bs]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in range(logits.shape[0])]
    if top_n > 0:
        vals, ids = logprobs.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return chosen, tops
