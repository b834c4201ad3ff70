"""A proposer for tests that knows each request's true continuation and plants wrong tokens.

The verify step is what the tests check; a proposer that is right for a random number of tokens
and then wrong exercises accepted runs of every length, rejections, and stops inside a run.
"""

from __future__ import annotations

import random

from pdserve.engine.speculative.adaptive import AdaptiveRule
from pdserve.engine.speculative.proposer import Draft


def FREE_RULE() -> AdaptiveRule:  # noqa: N802 - reads as the constant it stands for
    """The adaptive rule with a cost model that says speculation is free: every draft is verified
    (for tests of the verify step, not of the rule)."""
    return AdaptiveRule(16, fixed=(0.0, 0.0), beta=(0.0, 0.0), min_backoff=0, max_backoff=0)


class OracleProposer:
    name = "ORACLE"
    wants_hidden = False

    def __init__(self, truth: dict[str, list[int]], seed: int = 0, wrong: float = 0.5, strict: bool = True):
        """``strict``: the request's tokens must follow the truth (greedy); else drafts are the truth's
        tokens at the same positions, whatever came before (sampling)."""
        self.strict = strict
        self.truth = truth  # rid -> prompt + the continuation plain decoding gives
        self.rnd = random.Random(seed)
        self.wrong = wrong
        self.calls = 0
        self.released: set[str] = set()

    def propose(self, inputs):
        out = []
        for i in inputs:
            self.calls += 1
            full = self.truth.get(i.rid, [])
            n = len(i.token_ids)
            assert not self.strict or list(i.token_ids) == full[:n], f"{i.rid}: tokens diverged from the truth"
            draft = full[n : n + self.rnd.randint(0, i.max_tokens)]
            if draft and self.rnd.random() < self.wrong:
                j = self.rnd.randrange(len(draft))
                draft[j] = (draft[j] + 1) % 500
            out.append(Draft.chain(draft))
        return out

    def release(self, rid: str) -> None:
        self.released.add(rid)

    def close(self) -> None:
        pass
