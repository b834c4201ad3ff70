"""Each server started on one host gets KV event ports of its own.

``pdserve launch`` (and the planner's local connector) pass the same ``pdserve serve`` flags to
every server they start. ``--kv-events-config`` names ports (SGLang's example: PUB on 5557,
replay on 5558), so the second server on the host would fail to bind them. Here each server's
copy of the flag gets its tcp endpoints moved to ports free on this host, ``dp_size``
consecutive ones each (DP rank ``r`` binds port + r, ``kv_events_config.rank_endpoint``). The
router learns every server's endpoints from its ``/server_info``, so nothing else changes.
Non-tcp endpoints (ipc, inproc) are left as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pdserve.entrypoints.procs import free_port_run
from pdserve.engine.json_flags import json_object

FLAG = "--kv-events-config"


def _flag_value(args: Sequence[str], flag: str) -> tuple[int, str] | None:
    """(index of the flag's value in ``args``, the value), for ``--flag V`` and ``--flag=V``."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return i + 1, args[i + 1]
        if a.startswith(flag + "="):
            return i, a[len(flag) + 1:]
    return None


def _moved(endpoint: str, host: str, n: int) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    bind_host = endpoint[len("tcp://"):].rpartition(":")[0]
    return f"tcp://{bind_host}:{free_port_run(host, n)}"


def with_own_event_ports(args: Sequence[str], host: str = "127.0.0.1", dp_size: int | None = None) -> list[str]:
    """``args`` with ``--kv-events-config``'s tcp endpoint and replay endpoint on fresh ports, room
    for ``dp_size`` ranks each (None: ``args``' own ``--dp-size``, else 1)."""
    args = list(args)
    found = _flag_value(args, FLAG)
    if found is None:
        return args
    i, text = found
    obj = json_object(text, "kv_events_config")
    dp = _flag_value(args, "--dp-size")
    n = dp_size if dp_size is not None else int(dp[1]) if dp is not None else 1
    for key in ("endpoint", "replay_endpoint"):
        if obj.get(key):
            obj[key] = _moved(obj[key], host, n)
    if "endpoint" not in obj and obj.get("publisher", "null") != "null":  # the default's port, 5557
        obj["endpoint"] = _moved("tcp://*:5557", host, n)
    value = json.dumps(obj)
    args[i] = value if args[i] == text else f"{FLAG}={value}"
    return args
