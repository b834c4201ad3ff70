"""SGLang's control operations, for both front ends: the HTTP handlers and the offline Engine.

Each function takes the ``TokenizerManager`` and the operation's body (a
msgspec struct with SGLang's field names; unknown fields are refused), sends
the typed control message to every DP rank (``TokenizerManager.control``; the
ranks run it in ``engine/sched/rank_control.py``) and returns a
``ControlAnswer``: success, a message naming each rank that failed, and the
operation's data. What each one does to requests in flight is described there.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.kv_events_config import advertised_endpoints
from pdserve.engine.frontend.tokenizer_manager import TokenizerManager
from pdserve.engine.messages import (
    ControlResult,
    ExpertDistributionReq,
    FlushCacheReq,
    GetWeightsByNameReq,
    LoadLoraAdapterReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    StartProfileReq,
    StopProfileReq,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
)
from pdserve.engine.sched.rank_control import check_memory_tags
from pdserve.engine.version import VERSION

PROFILE_ACTIVITIES = ("CPU", "GPU")
_PROFILE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")  # a file name's part, never a path
MAX_TRUNCATE_SIZE = 4096  # rows /get_weights_by_name returns at most (an answer stays a few MiB)


# --- bodies (SGLang's io_struct names) ---------------------------------------------------------
class UpdateWeightsFromDiskInput(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    load_format: str | None = None  # only the model's own format ("auto"/None) is loaded here
    # True: requests in flight are aborted first; False (SGLang's default): they finish on the old weights
    abort_all_requests: bool = False
    flush_cache: bool = True  # the prefix cache always goes with the old weights


class GetWeightsByNameInput(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    truncate_size: int = 100


class MemoryOccupationInput(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None  # None: every tag (kv_cache, weights)


class ProfileInput(msgspec.Struct, forbid_unknown_fields=True):
    output_dir: str | None = None  # None: the profile folder itself; relative: under it
    num_steps: int | None = None  # None: until /stop_profile
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None


class LoadLoraAdapterInput(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's: keep it in a slot always; not supported here (slots are LRU)


class UnloadLoraAdapterInput(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str


class EmptyInput(msgspec.Struct, forbid_unknown_fields=True):
    """The body of a route that takes no fields (``{}``; any field is refused by name)."""


@dataclass
class ControlAnswer:
    success: bool
    message: str
    data: Any = None


def _answer(tm: TokenizerManager, results: list[ControlResult], ok_message: str = "") -> ControlAnswer:
    failed = [r for r in results if not r.success]
    if not failed:
        return ControlAnswer(True, ok_message or results[0].message)
    if tm.dp_size == 1:
        return ControlAnswer(False, failed[0].message)
    return ControlAnswer(False, "; ".join(f"DP rank {r.dp_rank}: {r.message}" for r in failed))


def nest(values: list[float], shape: list[int]) -> list:
    """A flat row-major list as nested lists of ``shape`` (what SGLang's ``tolist()`` returns)."""
    if len(shape) <= 1:
        return list(values)
    step = len(values) // shape[0] if shape[0] else 0
    return [nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


# --- operations ---------------------------------------------------------------------------------
async def flush_cache(tm: TokenizerManager) -> ControlAnswer:
    return _answer(tm, await tm.control(FlushCacheReq()), "Cache flushed.")


async def update_weights_from_disk(tm: TokenizerManager, inp: UpdateWeightsFromDiskInput) -> ControlAnswer:
    if inp.load_format not in (None, "auto"):
        raise RequestError(f"load_format {inp.load_format!r} is not supported (the checkpoint's own format is read)",
                           param="load_format")
    if not inp.flush_cache:
        raise RequestError("flush_cache false is not supported: the cached KV was computed by the old weights",
                           param="flush_cache")
    if inp.abort_all_requests:
        tm.abort_all("aborted by update_weights_from_disk")
    return _answer(tm, await tm.control(UpdateWeightsFromDiskReq(model_path=inp.model_path)),
                   f"Succeeded to update model weights from {inp.model_path}.")


async def get_weights_by_name(tm: TokenizerManager, inp: GetWeightsByNameInput) -> ControlAnswer:
    """The weight as the first DP rank holds it (every DP rank holds the same)."""
    if not 0 <= inp.truncate_size <= MAX_TRUNCATE_SIZE:
        raise RequestError(f"truncate_size must be in [0, {MAX_TRUNCATE_SIZE}], got {inp.truncate_size}",
                           param="truncate_size")
    results = await tm.control(GetWeightsByNameReq(name=inp.name, truncate_size=inp.truncate_size))
    answer = _answer(tm, results)
    if answer.success:
        answer.data = nest(results[0].values, results[0].shape)
    return answer


def _tags(inp: MemoryOccupationInput) -> list[str]:
    try:
        return check_memory_tags(inp.tags)
    except ValueError as e:
        raise RequestError(str(e), param="tags") from None


async def release_memory_occupation(tm: TokenizerManager, inp: MemoryOccupationInput) -> ControlAnswer:
    return _answer(tm, await tm.control(ReleaseMemoryReq(tags=_tags(inp))))


async def resume_memory_occupation(tm: TokenizerManager, inp: MemoryOccupationInput) -> ControlAnswer:
    return _answer(tm, await tm.control(ResumeMemoryReq(tags=_tags(inp))))


def profile_output_dir(requested: str | None, profile_dir: str | None, confined: bool) -> str:
    """Where a profile is written. ``confined`` (the HTTP route): under ``profile_dir`` only (a
    relative ``output_dir`` is taken from there; links are resolved before the check), and nowhere
    without one. The offline Engine's caller owns the process: any folder."""
    if not confined:
        return requested or profile_dir or tempfile.gettempdir()
    if not profile_dir:
        raise RequestError("profiling is off: start the server with --profile-dir (or PDSERVE_TORCH_PROFILER_DIR)",
                           param="output_dir", status=403, type="permission_denied", code="profiling_off")
    base = os.path.realpath(profile_dir)
    target = os.path.realpath(os.path.join(base, requested or ""))
    if target != base and not target.startswith(base + os.sep):
        raise RequestError(f"output_dir {requested!r} is outside --profile-dir {profile_dir!r}", param="output_dir")
    return target


async def start_profile(tm: TokenizerManager, inp: ProfileInput, confined: bool = False) -> ControlAnswer:
    activities = inp.activities or ["CPU"]
    for a in activities:
        if a not in PROFILE_ACTIVITIES:
            raise RequestError(f"activities: {a!r} is not one of {PROFILE_ACTIVITIES}", param="activities")
    if "GPU" in activities and not tm.config.engine.device.startswith("cuda"):
        raise RequestError("activities: GPU needs a CUDA device", param="activities")
    if inp.profile_id is not None and not _PROFILE_ID.fullmatch(inp.profile_id):
        raise RequestError("profile_id must be 1-64 letters, digits, '_', '-' or '.', not starting with '.'",
                           param="profile_id")
    req = StartProfileReq(
        output_dir=profile_output_dir(inp.output_dir, tm.config.profile_dir, confined),
        num_steps=inp.num_steps,
        record_shapes=bool(inp.record_shapes),
        with_stack=bool(inp.with_stack),
        profile_id=inp.profile_id or "",
    )
    return _answer(tm, await tm.control(req), "Start profiling.")


async def stop_profile(tm: TokenizerManager) -> ControlAnswer:
    return _answer(tm, await tm.control(StopProfileReq()))


async def start_expert_distribution_record(tm: TokenizerManager) -> ControlAnswer:
    return _answer(tm, await tm.control(ExpertDistributionReq(action="start")))


async def stop_expert_distribution_record(tm: TokenizerManager) -> ControlAnswer:
    return _answer(tm, await tm.control(ExpertDistributionReq(action="stop")))


async def dump_expert_distribution_record(tm: TokenizerManager) -> ControlAnswer:
    """The counts of every DP rank summed (each rank's already summed over its TP/EP ranks):
    ``data`` is SGLang's ``logical_count``, [num_layers][num_experts] token counts, returned in the
    answer rather than written to a file on the server."""
    results = await tm.control(ExpertDistributionReq(action="dump"))
    answer = _answer(tm, results, "Dumped the expert distribution.")
    if answer.success:
        total = [0] * len(results[0].values)
        for r in results:
            total = [a + int(b) for a, b in zip(total, r.values)]
        answer.data = nest(total, results[0].shape)
    return answer


async def load_lora_adapter(tm: TokenizerManager, inp: LoadLoraAdapterInput) -> ControlAnswer:
    """Every DP rank reads the adapter; once all have, requests may name it. ``data``: the adapters
    served, name -> path (SGLang's ``loaded_adapters``)."""
    if inp.pinned:
        raise RequestError("pinned adapters are not supported: adapters take slots on demand", param="pinned")
    _need_lora(tm)
    answer = _answer(tm, await tm.control(LoadLoraAdapterReq(lora_name=inp.lora_name, lora_path=inp.lora_path)))
    if answer.success:
        tm.lora_paths[inp.lora_name] = inp.lora_path
    answer.data = dict(tm.lora_paths)
    return answer


async def unload_lora_adapter(tm: TokenizerManager, inp: UnloadLoraAdapterInput) -> ControlAnswer:
    """Refused (by each rank) while a request uses the adapter. New requests stop naming it
    first, so that none arrives while the ranks unload; a refused unload serves it again."""
    _need_lora(tm)
    path = tm.lora_paths.pop(inp.lora_name, None)
    answer = _answer(tm, await tm.control(UnloadLoraAdapterReq(lora_name=inp.lora_name)))
    if not answer.success and path is not None:
        tm.lora_paths[inp.lora_name] = path
    answer.data = dict(tm.lora_paths)
    return answer


def _need_lora(tm: TokenizerManager) -> None:
    if not tm.config.engine.enable_lora:
        raise RequestError("this server was started without --enable-lora", param="lora_name", code="unsupported")


def server_info(tm: TokenizerManager) -> dict:
    """``/get_server_info``: the server's configuration (flat, by flag name, as SGLang's) and each
    DP rank's state."""
    c = tm.config
    info = asdict(c.engine)
    info.update({k: getattr(c, k) for k in c.server_field_names()})
    info.pop("api_key", None)
    info.pop("admin_api_key", None)
    info.update(
        {
            "version": VERSION,
            "served_model_name": c.model_name,
            "disaggregation_bootstrap_port": c.kv_transfer.bootstrap_port,
            "disaggregation_transfer_backend": c.kv_transfer.backend,
            "page_size": c.engine.page_size,
            "max_total_num_tokens": tm.max_total_num_tokens,
            # the KV pages' bytes of every DP rank together (each rank's over its TP ranks)
            "kv_pool_bytes": sum(r.kv_pool_bytes for r in tm.ready),
            "max_context_len": tm.model_info.max_context_len,
            "kv_events_endpoints": advertised_endpoints(c.kv_events, c.dp_size, c.advertise_host),
            "internal_states": [
                {
                    "dp_rank": r,
                    "num_running_reqs": s.num_running if s else None,
                    "num_waiting_reqs": s.num_waiting if s else None,
                    "num_running_tokens": s.num_running_tokens if s else None,
                    "num_queued_tokens": s.num_queued_tokens if s else None,
                    "num_free_pages": s.num_free_pages if s else None,
                    "num_total_pages": s.num_total_pages if s else None,
                    "max_total_num_tokens": tm.ready[r].max_total_num_tokens,
                    "kv_pool_bytes": tm.ready[r].kv_pool_bytes,
                    "inflight": tm.inflight[r],
                }
                for r, s in enumerate(tm.stats)
            ],
        }
    )
    return info
