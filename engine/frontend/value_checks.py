"""Value checks of a request body: ranges, ids, counts, refused fields, rids, bootstrap fields.

Each check raises a ``RequestError`` naming the body's field; ``RequestLimits`` holds what they need
to know about the server and the model.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.pd_rules import bootstrap_refusal, sequence_room
from pdserve.engine.frontend import refused_fields
from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.messages import BootstrapInfo
from pdserve.engine.net_allowlist import host_allowed, parse_allowlist

if TYPE_CHECKING:
    from pdserve.engine.frontend.request_schemas import GenerateRequest


# Bounds on what one request may ask of the event loop and the scheduler (each a 400 naming its field)
MAX_STOP_STRINGS = 64  # stop strings per sequence
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_BATCH_PROMPTS = 256  # prompts per batched /generate or /v1/completions body


@dataclass(frozen=True)
class RequestLimits:
    """What validation needs to know about the server and the model."""

    model_names: frozenset[str]
    max_n: int
    dp_size: int
    vocab_size: int
    disaggregation_mode: str = "null"
    max_local_prefill_tokens: int = 0  # decode mode: prompts this short may come without bootstrap fields
    # decode mode: the bootstrap hosts a request may name (--disaggregation-bootstrap-allowlist); empty: any
    bootstrap_allowlist: str = ""
    # the OpenAI endpoints' defaults for the sampling fields a request leaves out (--sampling-defaults model)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def check_model(self, model: str | None) -> None:
        """A RequestError unless ``model`` is None or a name this server serves."""
        if model is not None and model not in self.model_names:
            raise RequestError(
                f"The model `{model}` does not exist; this server serves {sorted(self.model_names)[0]!r}",
                param="model",
                code="model_not_found",
            )
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice auto needs one
    reasoning_parser: str | None = None  # --reasoning-parser: chat outputs split into reasoning and answer
    enable_priority_scheduling: bool = False  # --enable-priority-scheduling: `priority` is accepted
    lora_adapters: frozenset[str] = frozenset()  # the adapters of --lora-paths (lora_fields.py)

    def check_priority(self, priority: int | None) -> int:
        """The request's priority (0 when absent); a RequestError when the server does not order by it
        or the value is outside an int32 (SGLang's type)."""
        if priority is None:
            return 0
        if not self.enable_priority_scheduling:
            raise RequestError("`priority` needs a server started with --enable-priority-scheduling",
                               param="priority", code="unsupported")
        if not -(2**31) <= priority < 2**31:
            raise RequestError("`priority` must fit in an int32", param="priority")
        return priority


def new_rid() -> str:
    return uuid.uuid4().hex


def is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"{param} has token id {t}, outside the vocabulary [0, {vocab_size})", param=param)


def check_dp_rank(req, limits: RequestLimits) -> int | None:
    for name in ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"):
        rank = getattr(req, name)
        if rank is None:
            continue
        if name == "disagg_prefill_dp_rank" and limits.disaggregation_mode != "prefill":
            if rank < 0:  # a decode server: the rank is the prefill server's, checked by its bootstrap server
                raise RequestError(f"{name} must be >= 0, got {rank}", param=name)
            continue
        if not 0 <= rank < limits.dp_size:
            raise RequestError(f"{name} must be in [0, {limits.dp_size}), got {rank}", param=name)
    if req.routed_dp_rank is not None:
        return req.routed_dp_rank
    if req.data_parallel_rank is not None:
        return req.data_parallel_rank
    # a prefill server serves a room on the prefill rank the router picked
    if limits.disaggregation_mode == "prefill":
        return req.disagg_prefill_dp_rank
    return None


def _refuse(obj, table: dict[str, tuple], prefix: str = "") -> None:
    """A field set to a value pdserve does not implement is a 400 naming it (refused_fields.py)."""
    try:
        refused_fields.check(obj, table, prefix)
    except refused_fields.UnsupportedField as e:
        raise RequestError(str(e), param=e.param, code="unsupported") from None


def refuse_generate(req: "GenerateRequest") -> None:
    _refuse(req, refused_fields.GENERATE)
    sps = req.sampling_params
    for g in sps if isinstance(sps, list) else [sps] if sps is not None else []:
        _refuse(g, refused_fields.SAMPLING_PARAMS, "sampling_params.")


def refuse_openai(req, table: dict[str, tuple]) -> None:
    _refuse(req, table)
    if req.stream_options is not None:
        _refuse(req.stream_options, refused_fields.STREAM_OPTIONS, "stream_options.")


def unsupported(req, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(req, name, None) not in (None, [], {}):
            raise RequestError(f"`{name}` is not supported by pdserve", param=name, code="unsupported")


def pick(x, i: int):
    return x[i] if isinstance(x, list) else x


def bootstrap_infos(req, num_prompts: int, n: int, limits: RequestLimits,
                    prefill_rank: int | None) -> list[BootstrapInfo | None]:
    """The bootstrap fields of each sequence (prompt-major: prompt i's choice j at ``i * n + j``),
    checked (the PD rules: ``pd_rules.py``); each sequence has a room of its own
    (``sequence_room``)."""
    fields_ = (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if all(f is None for f in fields_):
        refusal = bootstrap_refusal(limits.disaggregation_mode, limits.max_local_prefill_tokens)
        if refusal is not None:
            raise RequestError(refusal, param="bootstrap_room")
        return [None] * (num_prompts * n)
    for name, f in zip(("bootstrap_host", "bootstrap_port", "bootstrap_room"), fields_):
        if f is None:
            raise RequestError(f"{name} is missing while other bootstrap fields are given", param=name)
        if isinstance(f, list) and len(f) != num_prompts:
            raise RequestError(f"{name} has {len(f)} entries for {num_prompts} prompts", param=name)
    out = []
    for i in range(num_prompts):
        room = pick(req.bootstrap_room, i)
        if not 0 <= room < 2**63:
            raise RequestError(f"bootstrap_room must be in [0, 2^63), got {room}", param="bootstrap_room")
        port, host = pick(req.bootstrap_port, i), pick(req.bootstrap_host, i)
        if not 0 < port < 65536:
            raise RequestError(f"bootstrap_port must be in [1, 65535], got {port}", param="bootstrap_port")
        # the decode side turns it into a URL: no empty, overlong or whitespace/control-character hosts
        if not host or len(host) > 255 or any(c.isspace() or not c.isprintable() or c in "/?#@" for c in host):
            raise RequestError(f"bootstrap_host must be a host name or address, got {host[:64]!r}",
                               param="bootstrap_host")
        if limits.bootstrap_allowlist and not host_allowed(parse_allowlist(limits.bootstrap_allowlist), host):
            raise RequestError(f"bootstrap_host {host!r} is not in this server's --disaggregation-bootstrap-allowlist "
                               f"({limits.bootstrap_allowlist})", param="bootstrap_host")
        for j in range(n):
            out.append(BootstrapInfo(host=host, port=port,
                                     room=sequence_room(req.bootstrap_room, i, j, num_prompts),
                                     prefill_dp_rank=prefill_rank))
    return out


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise RequestError("stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise RequestError(f"a stop string has {len(longest)} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
                           param="stop")
    return stops


def check_batch_size(num: int, param: str) -> None:
    if num > MAX_BATCH_PROMPTS:
        raise RequestError(f"{param} holds {num} prompts; a batch takes at most {MAX_BATCH_PROMPTS}", param=param)


def sequence_rids(rid: str | list[str] | None, count: int, n: int) -> list[str]:
    """One rid per sequence: the client's (suffixed per choice when n > 1), else fresh."""
    if rid is None:
        base = [new_rid() for _ in range(count)]
    elif isinstance(rid, str):
        if count != 1:
            raise RequestError("rid must be a list with one entry per prompt for a batch", param="rid")
        base = [rid]
    else:
        if len(rid) != count:
            raise RequestError(f"rid has {len(rid)} entries for {count} prompts", param="rid")
        base = list(rid)
    if len(set(base)) != len(base):
        raise RequestError("rid entries must be distinct", param="rid")
    if n == 1:
        return base
    return [f"{b}-{j}" for b in base for j in range(n)]


def check_n(n: int | None, limits: RequestLimits, param: str = "n") -> int:
    n = 1 if n is None else n
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"{param} must be in [1, {limits.max_n}], got {n}", param=param)
    return n


def check_max_tokens(value: int | None, param: str, minimum: int) -> None:
    if value is not None and value < minimum:
        raise RequestError(f"{param} must be >= {minimum}, got {value}", param=param)
