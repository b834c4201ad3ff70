"""Every environment variable pdserve reads, read here and nowhere else."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


# Set by tests and the launcher to pin a process's torch thread count.
PDSERVE_NUM_THREADS: int = _int("PDSERVE_NUM_THREADS", 0)
# Log level used when a CLI does not pass one.
PDSERVE_LOG_LEVEL: str = os.environ.get("PDSERVE_LOG_LEVEL", "info")
# UCX's own choice of network devices; when unset, the NIXL engine limits UCX to the interface of
# --host (kvtransfer/engines/nixl_engine.py), so its listeners do not open on every interface.
UCX_NET_DEVICES: str = os.environ.get("UCX_NET_DEVICES", "")
# Where /start_profile writes traces when the request names no output_dir (SGLang's
# SGLANG_TORCH_PROFILER_DIR).
PDSERVE_TORCH_PROFILER_DIR: str = os.environ.get("PDSERVE_TORCH_PROFILER_DIR", "/tmp")
# The router's keys (``--api-key`` for inference routes, ``--admin-api-key`` for the routes that
# change the router or its workers) when neither the flag nor its ``-file`` form is given: set them
# from a Kubernetes Secret, so that they never show in a process list. The planner sends the admin
# key from here too when it is not given ``--admin-api-key``.
PDSERVE_ROUTER_API_KEY: str = os.environ.get("PDSERVE_ROUTER_API_KEY", "")
PDSERVE_ROUTER_ADMIN_API_KEY: str = os.environ.get("PDSERVE_ROUTER_ADMIN_API_KEY", "")
