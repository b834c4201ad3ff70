"""Every message that crosses a process boundary inside an engine server.

The HTTP/tokenizer process sends requests to a scheduler process (one per DP
rank) and receives token outputs back, over ZMQ, encoded with msgspec.
Nothing crosses as an untyped dict. ``tests/engine/test_messages.py`` round-trips
each struct.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.sampling_params import SamplingParams


class BootstrapInfo(msgspec.Struct, frozen=True):
    """Where a disaggregated request's KV comes from (decode) or goes to (prefill)."""

    host: str
    port: int
    room: int
    prefill_dp_rank: int | None = None


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no prompt logprobs
    bootstrap: BootstrapInfo | None = None
    # /health_generate's probe: a prefill or decode rank runs it locally, without a KV peer (SGLang's
    # fake bootstrap): prefill computes the KV and drops it, decode prefills it itself
    health_probe: bool = False
    priority: int = 0  # with --enable-priority-scheduling: the waiting queue's order
    lora_path: str | None = None  # the LoRA adapter's name (--lora-paths); None: the base model
    # --enable-trace, this request sampled: TP rank 0 records its StageTimeline and returns it
    trace: bool = False


class AbortReq(msgspec.Struct, tag=True):
    rid: str
    reason: str = "aborted"


# --- control operations (SGLang's /flush_cache, /update_weights_from_disk, ...) -------------------
# Each carries the ``req_id`` its ``ControlResult`` answers with; every TP rank applies it (they
# follow TP rank 0's broadcast), TP rank 0 answers. ``engine/sched/rank_control.py`` runs them.


class FlushCacheReq(msgspec.Struct, tag=True):
    req_id: int = 0


class UpdateWeightsFromDiskReq(msgspec.Struct, tag=True):
    """Load another checkpoint of the same architecture. The rank holds new requests back, lets the
    ones it holds finish on the old weights, swaps, flushes the prefix cache, then runs the held ones."""

    model_path: str
    req_id: int = 0


class GetWeightsByNameReq(msgspec.Struct, tag=True):
    name: str  # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    truncate_size: int = 100  # first rows (a 1-D weight: first values)
    req_id: int = 0


class ReleaseMemoryReq(msgspec.Struct, tag=True):
    """Give the KV pool's memory (and/or the weights') back to the OS; only while idle."""

    tags: list[str]  # of rank_control.MEMORY_TAGS
    req_id: int = 0


class ResumeMemoryReq(msgspec.Struct, tag=True):
    tags: list[str]
    req_id: int = 0


class StartProfileReq(msgspec.Struct, tag=True):
    """torch.profiler over the rank's steps, its trace written to ``output_dir`` at stop (or after
    ``num_steps`` steps)."""

    output_dir: str
    num_steps: int | None = None
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str = ""  # the trace's file name prefix
    req_id: int = 0


class StopProfileReq(msgspec.Struct, tag=True):
    req_id: int = 0


class ExpertDistributionReq(msgspec.Struct, tag=True):
    """SGLang's expert distribution recorder: ``action`` "start", "stop" or "dump" (the dump's counts
    come back in ``ControlResult.values``/``shape``, [num_layers, num_experts])."""

    action: str
    req_id: int = 0


class LoadLoraAdapterReq(msgspec.Struct, tag=True):
    """Read the PEFT adapter at ``lora_path`` and serve it as ``lora_name`` (SGLang's
    /load_lora_adapter); its weights enter a slot when a request first uses it."""

    lora_name: str
    lora_path: str
    req_id: int = 0


class UnloadLoraAdapterReq(msgspec.Struct, tag=True):
    """Stop serving ``lora_name``; refused while a request on the rank uses it."""

    lora_name: str
    req_id: int = 0


class StageTimeline(msgspec.Struct):
    """Where a traced request's time went inside a scheduler rank, on ``time.monotonic`` (shared by
    the processes of one host): the HTTP process turns it into child spans
    (``engine/frontend/request_trace.py``). Times are None for stages the rank's role has not.

    ``chunks``: each prefill forward of the request as (start, end, prompt tokens computed);
    ``steps``: sampled decode forwards as (start, end, decode step index): the first, every
    ``DECODE_STEP_SAMPLE``-th and the last (``engine/sched/stage_recorder.py``)."""

    enqueued: float
    dp_rank: int = 0
    bootstrapped: float | None = None  # prefill: the decode's destination arrived
    prealloc_done: float | None = None  # decode: pages preallocated, destination sent
    chunks: list[tuple[float, float, int]] = []
    transfer_start: float | None = None  # prefill: first chunk handed over; decode: destination sent
    transfer_end: float | None = None  # prefill: last write done; decode: KV landed
    transfer_bytes: int = 0  # KV bytes of the room: written by this rank (prefill), received (decode)
    transfer_backend: str = ""
    steps: list[tuple[float, float, int]] = []
    num_steps: int = 0  # decode forwards the request took part in (sampled into ``steps``)
    num_retractions: int = 0
    finished: float | None = None
    # prompt tokens this rank's prefix cache served, by the tier they came from (the KV pool's are the
    # request's cached_tokens less these): the server span's attributes (request_trace.py)
    cached_host_tokens: int = 0
    cached_storage_tokens: int = 0


class TokenOutput(msgspec.Struct, tag=True):
    """Incremental output of one request: the tokens produced since the last one."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # per new token, when return_logprob: its logprob, and the top-k (token id, logprob) pairs
    new_logprobs: list[float] = []
    new_top_logprobs: list[list[tuple[int, float]]] = []
    # prompt logprobs, sent once with the first output when asked
    input_logprobs: list[float | None] = []
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    error: str | None = None
    error_status: int = 500  # the HTTP status of an error: 400 when the request itself was at fault
    # speculative decoding, running totals (SGLang's meta_info names), only from a rank that speculates:
    # verify steps with a draft, draft tokens checked, draft tokens accepted
    spec_verify_ct: int | None = None
    spec_draft_token_num: int | None = None
    spec_accept_token_num: int | None = None
    # the request's stage timeline, with its final output, when it was traced (TokenizedGenerateReq.trace)
    stages: StageTimeline | None = None


class SchedulerStats(msgspec.Struct, tag=True):
    dp_rank: int
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    page_size: int
    kv_auth_refused: int = 0  # KV control frames this rank refused by authentication (a running total)
    # PD queues, SGLang's gauge names (docs/ARCHITECTURE.md "Metrics and the request log"): prefill:
    # the bootstrap queue (SGLang's "prefill prealloc queue") and the inflight queue; decode:
    # prealloc, transfer
    num_prefill_prealloc_queue_reqs: int = 0
    num_prefill_inflight_queue_reqs: int = 0
    num_decode_prealloc_queue_reqs: int = 0
    num_decode_transfer_queue_reqs: int = 0
    num_quarantine_pages: int = 0  # decode: pages of failed rooms held until their prefill closed them
    # the load a router balances DP ranks by: tokens of the running batch's sequences, and of the
    # waiting queue's (what they would prefill)
    num_running_tokens: int = 0
    num_queued_tokens: int = 0


class SchedulerReady(msgspec.Struct, tag=True):
    """Sent once by a scheduler rank after its model and page pool are built."""

    dp_rank: int
    vocab_size: int
    max_context_len: int
    eos_token_ids: list[int]
    page_size: int
    max_total_num_tokens: int
    num_threads: int = 0
    kv_pool_bytes: int = 0  # the KV pages' bytes over this DP rank's TP ranks


class ControlResult(msgspec.Struct, tag=True):
    """A rank's answer to a control request. ``values``/``shape``: a tensor (get_weights_by_name),
    flattened, so that it crosses as typed floats."""

    dp_rank: int
    req_id: int
    success: bool
    message: str = ""
    values: list[float] = []
    shape: list[int] = []


class SchedulerError(msgspec.Struct, tag=True):
    """Sent by a scheduler rank that failed (at start or in its loop) before it exits."""

    dp_rank: int
    message: str


class MetricSample(msgspec.Struct, array_like=True, frozen=True):
    name: str  # the sample's name: the family's, or with _total, _bucket, _sum, _count
    labels: dict[str, str]
    value: float


class MetricFamily(msgspec.Struct, array_like=True, frozen=True):
    """One Prometheus metric family as a rank's ``prometheus_client`` registry collected it."""

    name: str
    type: str  # counter | gauge | histogram
    documentation: str
    samples: list[MetricSample]


class RankMetrics(msgspec.Struct, tag=True):
    """A scheduler process's own Prometheus families (its KV manager's rooms, bytes, latencies),
    sent by every TP rank when they changed; the front end serves them with ``dp_rank`` and
    ``tp_rank`` labels added (``ServerMetrics``)."""

    dp_rank: int
    tp_rank: int
    families: list[MetricFamily]


ControlReq = (
    FlushCacheReq | UpdateWeightsFromDiskReq | GetWeightsByNameReq | ReleaseMemoryReq | ResumeMemoryReq
    | StartProfileReq | StopProfileReq | ExpertDistributionReq | LoadLoraAdapterReq | UnloadLoraAdapterReq
)
SchedulerInput = TokenizedGenerateReq | AbortReq | ControlReq
SchedulerOutput = TokenOutput | SchedulerStats | SchedulerReady | SchedulerError | RankMetrics | ControlResult
