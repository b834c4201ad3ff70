"""What the main process knows about one sequence in flight, and one update of it.

The tokenizer manager owns a ``SeqState`` per sequence (one prompt, one choice),
folds each ``TokenOutput`` from the scheduler into it, and hands the HTTP
handler a ``Delta`` (what is new) alongside the state (everything so far).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.frontend.sequences import SequenceSpec


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool


@dataclass(eq=False)
class SeqState:
    spec: SequenceSpec
    input_ids: list[int]
    dp_rank: int | None = None
    num_prompts_in_batch: int = 0  # > 0: part of a batch, outputs carry their index
    detok: Any = None  # the incremental detokenizer
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # speculative decoding's totals (TokenOutput's spec_* fields); None where the rank does not speculate
    spec_verify_ct: int | None = None
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    error: str | None = None
    error_status: int = 500
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def rid(self) -> str:
        return self.spec.rid

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def e2e_latency(self) -> float:
        end = self.finished_time if self.finished_time is not None else time.monotonic()
        return end - self.created
