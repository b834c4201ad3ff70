"""The verify step's acceptance rule: which draft tokens stand, and the bonus token after them.

A chain of ``k`` drafts is scored by ``k + 1`` rows of target logits: row ``i`` is the target's
distribution for the token after the fed token and drafts ``0..i-1``. The accepted run is the
longest prefix of drafts the rule keeps, then one more token from the row where it stopped (the
correction of a rejected draft, or the bonus after a fully accepted chain).

- Greedy: a draft stands while it equals its row's argmax; the run is then exactly what plain
  greedy decoding would output, token for token.
- Sampling (temperature, top-k, top-p, min-p): standard speculative rejection sampling (Leviathan et
  al. 2023; Chen et al. 2023). The proposers here are deterministic, so the draft distribution is a
  point mass ``q = delta(x)``: draft ``x`` is accepted with probability ``min(1, p(x) / q(x)) = p(x)``,
  else the token is drawn from the residual ``max(p - q, 0)``, which is ``p`` with ``x`` removed and
  renormalized. Each emitted token is then distributed exactly as ``p``.

``probs`` rows are the target's processed distributions (temperature, filters, renormalized), as
``kernels.sampling`` samples plain decode steps from.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from pdserve.kernels.sampling import renorm_probs, seeded_uniform


def accept_greedy(target_ids: Sequence[int], draft: Sequence[int]) -> list[int]:
    """``target_ids``: each row's argmax (``len(draft) + 1`` of them). The accepted drafts, then the bonus."""
    out: list[int] = []
    for d, t in zip(draft, target_ids):
        out.append(t)
        if t != d:
            return out
    out.append(target_ids[len(draft)])
    return out


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], uniforms: Sequence[tuple[float, float]]) -> list[int]:
    """Rejection sampling of a point-mass draft chain. ``probs``: [len(draft) + 1, vocab] rows summing
    to 1; ``uniforms[i]``: row i's (accept test, residual draw) uniforms in [0, 1)."""
    out: list[int] = []
    for i, x in enumerate(draft):
        t = sample_row(probs[i], x, uniforms[i])
        out.append(t)
        if t != x:
            return out
    out.append(sample_row(probs[len(draft)], None, uniforms[len(draft)]))
    return out


def sample_row(row: torch.Tensor, draft: int | None, uniforms: tuple[float, float]) -> int:
    """One position: the draft token if accepted (probability ``row[draft]``), else a draw from the
    residual; with no draft, a plain draw from ``row``."""
    u_accept, u_draw = uniforms
    if draft is None:
        return _draw(row, u_draw)
    if u_accept < float(row[draft]):
        return int(draft)
    residual = row.clone()
    residual[draft] = 0.0
    return _draw(residual, u_draw)


def _draw(row: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from an unnormalized row (zero-mass entries never drawn)."""
    cdf = row.cumsum(0)
    pos = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(pos, row.shape[0] - 1)


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """[rows, vocab] float32 -> the distributions plain sampling draws from (``kernels.sampling``'s rules)."""
    # logits: [rows, vocab]
    rows, vocab = logits.shape
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    k = vocab if (top_k < 0 or top_k > vocab) else top_k
    if k < vocab or top_p < 1.0 or min_p > 0.0:
        full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
        probs = renorm_probs(probs, full(k, torch.int64), full(top_p, torch.float32), full(min_p, torch.float32))
    return probs


def step_uniforms(seed: int | None, first_step: int, n: int, rng: random.Random) -> list[tuple[float, float]]:
    """``n`` rows' (accept, draw) uniforms: from ``(seed, output position)`` for a seeded request, so
    its tokens do not depend on its batch; else from the rank's ``rng`` (seeded alike on every TP rank
    and drawn in batch order, so every rank accepts the same tokens)."""
    if seed is None:
        return [(rng.random(), rng.random()) for _ in range(n)]
    return [(random.Random(f"{seed}:{first_step + i}:accept").random(), seeded_uniform(seed, first_step + i))
            for i in range(n)]
