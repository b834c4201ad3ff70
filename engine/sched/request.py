"""One request inside a scheduler rank, with an explicit status.

The statuses include the disaggregated (PD) states so that the prefill and
decode modes reuse this type instead of wrapping it:

    null mode:     WAITING -> RUNNING -> FINISHED   (RUNNING -> WAITING on retract)
    prefill mode:  WAITING_FOR_BOOTSTRAP -> WAITING -> RUNNING (prefill) -> SENDING_KV -> FINISHED
    decode mode:   WAITING_FOR_KV -> RUNNING (decode) -> FINISHED

KV bookkeeping: the KV of token ``t`` of ``fill_ids`` lives in slot
``pages[t // page_size] * page_size + t % page_size``. ``kv_len`` tokens have
their KV computed. The first ``num_cache_pages`` pages belong to the prefix
cache (locked through ``cache_node`` while the request runs); the rest are
owned by the request and freed or handed to the cache when it ends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.mem_cache.radix_cache import cache_key
from pdserve.engine.messages import BootstrapInfo, StageTimeline
from pdserve.engine.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill, holds no pages
    RUNNING = "running"  # admitted: prefilling (maybe in chunks) or decoding, holds pages
    FINISHED = "finished"
    WAITING_FOR_BOOTSTRAP = "waiting_for_bootstrap"  # prefill side: waiting for the decode peer
    SENDING_KV = "sending_kv"  # prefill side: prefill done, KV pages being written to the peer
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: pages preallocated, KV arriving


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort" | "error"
    matched: int | str | None = None  # stop token id or stop string that ended it
    message: str | None = None  # for "abort" / "error"
    status: int = 500  # an error's HTTP status: 400 when the request itself was at fault (its grammar)


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: BootstrapInfo | None = None
    logprob_start_len: int = -1  # >= 0: report logprobs of prompt tokens from this position on
    health_probe: bool = False  # /health_generate: PD modes run it without a peer (messages.py)
    priority: int = 0  # the waiting queue's order with enable_priority_scheduling (priority_order.py)
    arrival: int = 0  # the scheduler's arrival count: preemption takes the latest of a priority first
    lora_name: str | None = None  # the LoRA adapter the request runs under (None: the base model)
    lora_id: int = 0  # its prefix-cache namespace (> 0; 0: the base model's)

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # KV state (see module docstring)
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    num_cache_pages: int = 0
    cache_node: Any = None
    # tokens of the prompt served from the prefix cache at first admission (reported)
    cached_tokens: int = 0
    # of those, the tokens loaded from the host tier, and from what the storage tier fetched
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    admitted_once: bool = False
    # output bookkeeping
    finish_reason: FinishReason | None = None
    num_sent: int = 0  # output tokens already reported in a TokenOutput
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # logprob of prompt token p given its prefix, for p = logprob_start_len.. (None for p = 0)
    input_logprobs: list[float | None] = field(default_factory=list)
    # text decoded so far, kept only when stop strings must be matched
    text_state: Any = None
    num_retractions: int = 0
    # speculative decoding (SGLang's meta_info names): verify steps with a draft, drafts checked, accepted
    spec_verify_ct: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the LoRA slot the adapter sits in while the request runs (-1: none held)
    lora_slot: int = -1
    # structured output: the request's grammar matcher (constrained.RequestGrammar), None if unconstrained
    grammar: Any = None
    # --enable-trace, a traced request on TP rank 0: where its time went (sched/stage_recorder.py)
    timeline: StageTimeline | None = None

    @property
    def fill_ids(self) -> list[int]:
        """All tokens whose KV the sequence needs: prompt then outputs."""
        return self.input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building ``fill_ids`` (a decode step's one token, of a
        sequence of any length)."""
        p = len(self.input_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[: end - p]

    def cache_key(self, end: int) -> list[int]:
        """``fill_ids[:end]`` as the prefix cache keys them: in the namespace of the request's adapter."""
        return cache_key(self.fill_ids[:end], self.lora_id)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all gathered yet."""
        return 0 <= self.logprob_start_len < self.prompt_len and (
            self.logprob_start_len + len(self.input_logprobs) < self.prompt_len
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, {self.status.name}, prompt={self.prompt_len}, "
            f"out={len(self.output_ids)}, kv={self.kv_len}, pages={len(self.pages)})"
        )
