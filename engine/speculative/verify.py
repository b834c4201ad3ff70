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

A tree of drafts (several branches: ``parents[j]`` is node ``j``'s parent, -1 the fed token) is
scored by one row per node plus the fed token's row (row 0; node ``j``'s row is ``1 + j``) and
accepted along one path from the fed token:

- Greedy: follow the child whose token is the target's argmax at the current node; where no child
  matches, that argmax is the bonus. The path is then plain greedy decoding's tokens.
- Sampling: multi-candidate rejection sampling for point-mass drafts (SpecInfer, Miao et al. 2024;
  SGLang's tree verify): at a node the children are tried in order, child ``c`` is accepted with
  probability ``r(c)`` under the current residual ``r`` (first ``p``), and on rejection ``r(c)`` is
  zeroed and ``r`` renormalized; if every child is rejected the token is drawn from ``r``. Each
  step's token is then distributed exactly as ``p`` (tests/speculative/test_tree_verify.py).

``probs`` rows are the target's processed distributions (temperature, filters, renormalized), as
``kernels.sampling`` samples plain decode steps from.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from pdserve.engine.speculative.proposer import tree_children
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


def accept_greedy_tree(target_ids: Sequence[int], tokens: Sequence[int],
                       parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """``target_ids[1 + j]``: node ``j``'s row's argmax (``[0]`` the fed token's). Returns the tokens
    gained (the accepted nodes' tokens, then the bonus) and the accepted nodes, root to leaf."""
    children = tree_children(parents)
    out: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        t = target_ids[node + 1]
        out.append(t)
        node = next((c for c in children[node + 1] if tokens[c] == t), None)
        if node is None:
            return out, path
        path.append(node)


class TreeUniforms:
    """The uniforms of a tree's rejection sampling: per depth ``d`` (output position ``first_step +
    d``) one draw, and one accept test per child tried. The first child's test and the draw are
    ``step_uniforms``' pair, so a chain draws exactly as ``accept_sampled``; further children's tests
    come from ``(seed, position, rank)`` for a seeded request, else from ``rng`` as they are needed
    (every TP rank asks in the same order)."""

    def __init__(self, seed: int | None, first_step: int, depths: int, rng: random.Random):
        self.seed, self.first_step, self.rng = seed, first_step, rng
        self.pairs = step_uniforms(seed, first_step, depths, rng)

    def accept(self, depth: int, rank: int) -> float:
        if rank == 0:
            return self.pairs[depth][0]
        if self.seed is None:
            return self.rng.random()
        return random.Random(f"{self.seed}:{self.first_step + depth}:accept:{rank}").random()

    def draw(self, depth: int) -> float:
        return self.pairs[depth][1]


def sample_tree_row(row: torch.Tensor, candidates: Sequence[int], uniforms: TreeUniforms,
                    depth: int) -> tuple[int, int | None]:
    """One node's step: try ``candidates`` (the children's tokens) in order against the residual;
    returns the token and the index in ``candidates`` of the accepted one (None: drawn from the residual)."""
    residual = row
    for rank, x in enumerate(candidates):
        mass = float(residual.sum())
        if mass > 0 and uniforms.accept(depth, rank) * mass < float(residual[x]):
            return int(x), rank
        if float(residual[x]) > 0:
            residual = residual.clone() if residual is row else residual
            residual[x] = 0.0
    return _draw(residual, uniforms.draw(depth)), None


def accept_sampled_tree(probs: torch.Tensor, tokens: Sequence[int], parents: Sequence[int],
                        uniforms: TreeUniforms) -> tuple[list[int], list[int]]:
    """Multi-candidate rejection sampling over a point-mass draft tree. ``probs``: [1 + len(tokens),
    vocab] rows summing to 1 (row 0 the fed token's). Returns the tokens gained and the accepted nodes."""
    children = tree_children(parents)
    out: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        kids = children[node + 1]
        t, rank = sample_tree_row(probs[node + 1], [tokens[c] for c in kids], uniforms, len(out))
        out.append(t)
        if rank is None:
            return out, path
        node = kids[rank]
        path.append(node)


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
