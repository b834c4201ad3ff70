"""Control operations on one scheduler rank, between its steps.

SGLang's control endpoints reach every rank as typed messages
(``engine/messages.py``: ``FlushCacheReq``, ``UpdateWeightsFromDiskReq``,
``GetWeightsByNameReq``, ``ReleaseMemoryReq``/``ResumeMemoryReq``,
``StartProfileReq``/``StopProfileReq``); ``RankControl.handle`` runs each on the
rank's loop and answers with a ``ControlResult``. Under TP every TP rank runs
them (they apply TP rank 0's broadcast in the same order), so every shard
changes together; TP rank 0's answer is the one that is sent.

Semantics, as SGLang's:

- ``update_weights_from_disk``: requests already on the rank finish on the old
  weights; requests that arrive meanwhile are held back and run on the new
  ones. The swap happens when the loop is idle, and the prefix cache is flushed
  with it (its KV was computed by the old weights). (The front end can abort
  what is in flight first: SGLang's ``abort_all_requests``.)
- ``release_memory_occupation``: only while idle. ``kv_cache`` flushes the
  prefix cache and gives the pool's pages back to the OS at unchanged
  addresses (``host_memory.discard_pages``); ``weights`` frees the model's
  tensors. Until ``resume_memory_occupation`` a new request ends at once with
  an error naming what is released.
- ``start_profile``: torch.profiler over the following steps; the trace is
  written at ``stop_profile`` or after ``num_steps`` steps.
- expert distribution (``ExpertDistributionReq``): ``start`` zeroes the
  per-layer, per-expert counts and counts from the next step, ``stop`` stops,
  ``dump`` answers the counts summed over the TP group and resets them
  (``engine/model_executor/expert_recorder.py``). Every TP rank runs the
  dump's all-reduce, so it raises nothing before it.
"""

from __future__ import annotations

import logging
import os
import time

from pdserve.engine.messages import (
    AbortReq,
    ControlResult,
    ExpertDistributionReq,
    FlushCacheReq,
    GetWeightsByNameReq,
    LoadLoraAdapterReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    StartProfileReq,
    StopProfileReq,
    TokenizedGenerateReq,
    TokenOutput,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
)
from pdserve.engine.sched import lora_control

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights")  # SGLang's tags that have something to free here


def check_memory_tags(tags: list[str] | None) -> list[str]:
    """The tags to act on (None: all, as SGLang); ValueError naming an unknown one."""
    if tags is None:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag {unknown[0]!r} (known: {', '.join(MEMORY_TAGS)})")
    return list(tags)


class RankControl:
    def __init__(self, loop, dp_rank: int, tp_rank: int = 0):
        self.loop = loop
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank
        self.held: list[TokenizedGenerateReq] = []  # arrived while a weight update waits
        self.pending_update: UpdateWeightsFromDiskReq | None = None
        self.released: set[str] = set()
        self._profiler = None
        self._profile: StartProfileReq | None = None
        self._profile_steps_left: int | None = None

    def _result(self, req, success: bool, message: str = "", **extra) -> ControlResult:
        return ControlResult(dp_rank=self.dp_rank, req_id=req.req_id, success=success, message=message, **extra)

    # ------------------------------------------------------------------ inputs
    def handle(self, msg) -> list:
        """Apply one input message; returns what to send now (results, refusals). A control
        operation that raises is answered with its error: the rank lives on."""
        if isinstance(msg, (TokenizedGenerateReq, AbortReq)):
            return self._apply(msg)
        try:
            return self._apply(msg)
        except Exception as e:  # noqa: BLE001 - the answer carries it
            logger.exception("control operation %s failed", type(msg).__name__)
            return [self._result(msg, False, f"{type(e).__name__}: {e}")]

    def _apply(self, msg) -> list:
        if isinstance(msg, TokenizedGenerateReq):
            return self._add_request(msg)
        if isinstance(msg, AbortReq):
            self.held = [r for r in self.held if r.rid != msg.rid]
            self.loop.abort(msg.rid)
            return []
        if isinstance(msg, FlushCacheReq):
            ok = self.loop.flush_cache()
            return [self._result(msg, ok, "" if ok else "not flushed: requests are running or waiting")]
        if isinstance(msg, UpdateWeightsFromDiskReq):
            if self.pending_update is not None:
                return [self._result(msg, False, "another weight update is in progress")]
            self.pending_update = msg
            return self.poll()
        if isinstance(msg, GetWeightsByNameReq):
            return [self._get_weights(msg)]
        if isinstance(msg, ReleaseMemoryReq):
            return [self._release(msg)]
        if isinstance(msg, ResumeMemoryReq):
            return [self._resume(msg)]
        if isinstance(msg, StartProfileReq):
            return [self._start_profile(msg)]
        if isinstance(msg, StopProfileReq):
            return [self._stop_profile(msg)]
        if isinstance(msg, ExpertDistributionReq):
            return [self._expert_distribution(msg)]
        if isinstance(msg, (LoadLoraAdapterReq, UnloadLoraAdapterReq)):
            return [self._lora(msg)]
        raise TypeError(f"unexpected scheduler input {type(msg).__name__}")

    def _add_request(self, msg: TokenizedGenerateReq) -> list:
        if self.pending_update is not None:
            self.held.append(msg)
            return []
        if self.released:
            what = " and ".join(sorted(self.released))
            return [TokenOutput(rid=msg.rid, new_token_ids=[], prompt_tokens=len(msg.input_ids), completion_tokens=0,
                                finished=True, finish_reason="error",
                                error=f"memory occupation ({what}) is released; call resume_memory_occupation first")]
        self.loop.add_request(msg)
        return []

    # -------------------------------------------------------------- per step
    def poll(self) -> list:
        """Between steps: a weight update waiting for the loop to be idle runs now, if it is."""
        if self.pending_update is None or self.loop.has_work():
            return []
        req, self.pending_update = self.pending_update, None
        try:
            self.loop.runner.load_weights(req.model_path)
            self.released.discard("weights")  # released weights are back, the new ones
            self.loop.weights_changed()
            result = self._result(req, True, f"weights updated from {req.model_path}")
        except Exception as e:  # noqa: BLE001 - the answer carries it; the old weights stay
            logger.exception("weight update from %s failed", req.model_path)
            result = self._result(req, False, f"{type(e).__name__}: {e}")
        held, self.held = self.held, []
        outs: list = [result]
        for msg in held:
            outs.extend(self._add_request(msg))
        return outs

    def after_step(self) -> None:
        """Count a model step for a profile of ``num_steps`` steps; a trace that cannot be written
        is logged and dropped (the rank lives on)."""
        if self._profile_steps_left is not None:
            self._profile_steps_left -= 1
            if self._profile_steps_left <= 0:
                try:
                    self._write_profile()
                except Exception:  # noqa: BLE001 - nobody waits on this trace's answer
                    logger.exception("profile trace could not be written")

    # ---------------------------------------------------------------- weights
    def _get_weights(self, req: GetWeightsByNameReq) -> ControlResult:
        from pdserve.engine.model_executor.weight_names import weight_by_name

        model = self.loop.runner.model
        if model is None:
            return self._result(req, False, "the weights are released")
        try:
            t = weight_by_name(model, req.name)[: max(req.truncate_size, 0)].cpu()
        except ValueError as e:
            return self._result(req, False, str(e))
        return self._result(req, True, values=t.flatten().tolist(), shape=list(t.shape))

    # ----------------------------------------------------------------- memory
    def _release(self, req: ReleaseMemoryReq) -> ControlResult:
        try:
            tags = check_memory_tags(req.tags)
        except ValueError as e:
            return self._result(req, False, str(e))
        if self.loop.has_work() or self.pending_update is not None:
            return self._result(req, False, "the rank is not idle: release memory occupation when no request runs")
        done = []
        runner, pool = self.loop.runner, self.loop.pool
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.loop.flush_cache()  # the cached KV is lost with the pages
            mib = pool.release_memory() / 2**20
            done.append(f"kv_cache ({mib:.0f} MiB)")
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            runner.release_weights()
            done.append("weights")
            self.released.add("weights")
        return self._result(req, True, "released " + (", ".join(done) or "nothing (already released)"))

    def _resume(self, req: ResumeMemoryReq) -> ControlResult:
        try:
            tags = check_memory_tags(req.tags)
        except ValueError as e:
            return self._result(req, False, str(e))
        try:
            if "kv_cache" in tags and "kv_cache" in self.released:
                self.loop.pool.resume_memory()
                self.released.discard("kv_cache")
            if "weights" in tags and "weights" in self.released:
                self.loop.runner.resume_weights()
                self.released.discard("weights")
        except Exception as e:  # noqa: BLE001 - the answer carries it
            logger.exception("resume_memory_occupation failed")
            return self._result(req, False, f"{type(e).__name__}: {e}")
        return self._result(req, True, "resumed" + (f"; still released: {sorted(self.released)}" if self.released else ""))

    # ------------------------------------------------------------------ LoRA
    def _lora(self, req) -> ControlResult:
        """Load or unload an adapter (``lora_control.py``); a refusal is the answer, the rank lives on.
        Every TP rank runs it on the same state, so they agree."""
        try:
            if isinstance(req, LoadLoraAdapterReq):
                message = lora_control.load_adapter(self.loop, req.lora_name, req.lora_path)
            else:
                message = lora_control.unload_adapter(self.loop, req.lora_name)
        except ValueError as e:
            return self._result(req, False, str(e))
        return self._result(req, True, message)

    # ---------------------------------------------------- expert distribution
    def _expert_distribution(self, req: ExpertDistributionReq) -> ControlResult:
        recorder = self.loop.runner.expert_recorder
        if req.action == "dump":
            if recorder.num_experts == 0:  # the same on every TP rank: none of them reduces
                return self._result(req, False, "the model has no routed experts to record")
            counts = recorder.dump()  # [L, E]: the TP group's all-reduce
            return self._result(req, True, "", values=[float(v) for v in counts.flatten().tolist()],
                                shape=list(counts.shape))
        if req.action == "start":
            recorder.start()
            return self._result(req, True, "Start recording the expert distribution.")
        if req.action == "stop":
            recorder.stop()
            return self._result(req, True, "Stop recording the expert distribution.")
        return self._result(req, False, f"unknown expert distribution action {req.action!r}")

    # -------------------------------------------------------------- profiling
    def _start_profile(self, req: StartProfileReq) -> ControlResult:
        import torch

        if self._profiler is not None:
            return self._result(req, False, "a profile is already running")
        if req.num_steps is not None and req.num_steps < 1:
            return self._result(req, False, f"num_steps must be >= 1, got {req.num_steps}")
        os.makedirs(req.output_dir, mode=0o700, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.loop.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=req.record_shapes,
                                                with_stack=req.with_stack)
        self._profiler.start()
        self._profile = req
        self._profile_steps_left = req.num_steps
        return self._result(req, True, f"profiling to {req.output_dir}")

    def _stop_profile(self, req: StopProfileReq) -> ControlResult:
        if self._profiler is None:
            return self._result(req, False, "no profile is running")
        path = self._write_profile()
        return self._result(req, True, f"trace written to {path}")

    def _write_profile(self) -> str:
        prof, start = self._profiler, self._profile
        self._profiler = self._profile = self._profile_steps_left = None  # a failed write ends the profile too
        prof.stop()
        name = f"{start.profile_id or int(time.time())}-DP{self.dp_rank}-TP{self.tp_rank}.trace.json.gz"
        path = os.path.join(start.output_dir, name)
        prof.export_chrome_trace(path)
        logger.info("profile written to %s", path)
        return path
