"""``pdserve launch``'s plan: the launch configuration and the servers it makes of it.

Pure logic over the flags: which servers start (prefill, decode, the router), on which ports,
pinned to which cores (``--cpu-split auto``: each server its own share of this process's cores)
and with which ``pdserve serve`` flags; the KV key and the admin key a launch off loopback hands
its servers and router, and whether it runs its own Mooncake store. ``cluster.py`` starts and supervises what this plans.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

from pdserve.entrypoints.event_ports import with_own_event_ports
from pdserve.entrypoints.procs import STOP_GRACE_S, free_port
from pdserve.engine.transfer_backends import TRANSFER_ENGINES

CPU_SPLITS = ("auto", "none")
# flags of `pdserve serve` that launch sets itself for each server
_OWNED_SERVE_FLAGS = (
    "--host", "--port", "--dp-size", "--tp-size", "--model-path", "--disaggregation-mode",
    "--disaggregation-bootstrap-port", "--disaggregation-transfer-backend", "--max-local-prefill-tokens",
)


class LaunchError(RuntimeError):
    """The cluster could not start (a process died or did not become healthy in time)."""


@dataclass(frozen=True)
class LaunchConfig:
    prefill: int = 1  # prefill servers
    decode: int = 1  # decode servers
    dp_size: int = 1  # DP ranks of every server, unless prefill_dp_size / decode_dp_size say otherwise
    prefill_dp_size: int | None = None
    decode_dp_size: int | None = None
    tp_size: int = 1  # TP processes per DP rank of every server, unless prefill_tp_size / decode_tp_size say otherwise
    prefill_tp_size: int | None = None
    decode_tp_size: int | None = None
    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    transfer_backend: str = "mooncake"
    host: str = "127.0.0.1"  # every server and the router bind here
    port: int = 8000  # the router's (public) port; 0: a free one
    cpu_split: str = "none"  # auto: pin each server to its own share of the cores
    log_dir: str | None = None  # None: a new temporary directory
    startup_timeout: float = 600.0  # seconds for every server to load its model
    stop_grace: float = STOP_GRACE_S  # seconds between SIGTERM and SIGKILL (the whole stop stays under 10 s)
    # share of the host's memory for the weights and KV pages of every server together (each of the
    # n servers gets --mem-fraction-static mem_fraction_static / n)
    mem_fraction_static: float = 0.25
    # conditional disaggregation: prompts of at most this many uncached tokens prefill on a decode
    # server (the router's --local-prefill-max-tokens, the decode servers' --max-local-prefill-tokens); 0: off
    local_prefill_max_tokens: int = 0
    engine_args: tuple[str, ...] = ()  # extra `pdserve serve` flags for every server
    router_args: tuple[str, ...] = ()  # extra router flags
    planner: bool = False  # run the SLA planner (local connector) over the cluster
    planner_port: int = 0  # the planner's own /metrics port; 0: a free one
    planner_args: tuple[str, ...] = ()  # `pdserve planner` flags (--profile, SLOs, limits, ...)

    def __post_init__(self):
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"--prefill and --decode must be >= 1, got {self.prefill} and {self.decode}")
        for name in ("dp_size", "prefill_dp_size", "decode_dp_size", "tp_size", "prefill_tp_size", "decode_tp_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.transfer_backend not in TRANSFER_ENGINES:
            raise ValueError(f"--transfer-backend must be one of {list(TRANSFER_ENGINES)}, got {self.transfer_backend!r}")
        if self.cpu_split not in CPU_SPLITS:
            raise ValueError(f"--cpu-split must be one of {CPU_SPLITS}, got {self.cpu_split!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.model_path is not None and not os.path.exists(self.model_path):
            raise ValueError(f"--model-path: no such file or directory: {self.model_path}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.startup_timeout <= 0 or self.stop_grace <= 0:
            raise ValueError("--startup-timeout and --stop-grace must be > 0")
        if self.planner_args and not self.planner:
            raise ValueError("--planner-arg needs --planner")
        if self.planner and (self.prefill_dp != self.decode_dp or self.prefill_tp != self.decode_tp):
            raise ValueError("--planner: the planner starts servers of one DP and TP size; give both roles the same")
        if not 0 <= self.planner_port < 65536:
            raise ValueError(f"--planner-port must be in [0, 65535], got {self.planner_port}")
        for flag in self.engine_args:
            if flag.split("=")[0] in _OWNED_SERVE_FLAGS:
                raise ValueError(f"{flag.split('=')[0]} is set by launch for each server; use launch's own flags")

    @property
    def prefill_dp(self) -> int:
        return self.prefill_dp_size or self.dp_size

    @property
    def decode_dp(self) -> int:
        return self.decode_dp_size or self.dp_size

    @property
    def prefill_tp(self) -> int:
        return self.prefill_tp_size or self.tp_size

    @property
    def decode_tp(self) -> int:
        return self.decode_tp_size or self.tp_size


@dataclass(frozen=True)
class ServerSpec:
    """One process launch starts."""

    name: str  # prefill-0, decode-0, router
    argv: tuple[str, ...]
    url: str
    cpus: tuple[int, ...] | None = None  # affinity; None: inherit
    bootstrap_port: int | None = None


def split_cpus(cpus: list[int], n: int) -> list[tuple[int, ...]]:
    """``n`` shares of ``cpus``: contiguous and as equal as possible, or one core each
    (round robin, shared) when there are fewer cores than servers."""
    cpus = sorted(cpus)
    if n <= len(cpus):
        base, extra = divmod(len(cpus), n)
        out, i = [], 0
        for k in range(n):
            size = base + (1 if k < extra else 0)
            out.append(tuple(cpus[i:i + size]))
            i += size
        return out
    return [(cpus[k % len(cpus)],) for k in range(n)]


def plan(config: LaunchConfig) -> list[ServerSpec]:
    """The processes of the cluster: prefill servers, decode servers, then the router (ports chosen here)."""
    python = sys.executable
    n_servers = config.prefill + config.decode
    shares: list[tuple[int, ...] | None] = [None] * n_servers
    if config.cpu_split == "auto":
        shares = split_cpus(list(os.sched_getaffinity(0)), n_servers)
    url_host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    specs = []
    for i in range(n_servers):
        role = "prefill" if i < config.prefill else "decode"
        idx = i if role == "prefill" else i - config.prefill
        dp = config.prefill_dp if role == "prefill" else config.decode_dp
        tp = config.prefill_tp if role == "prefill" else config.decode_tp
        port = free_port(url_host)
        argv = [python, "-m", "pdserve.engine", "--host", config.host, "--port", str(port), "--dp-size", str(dp),
                "--tp-size", str(tp), "--disaggregation-mode", role, "--disaggregation-transfer-backend", config.transfer_backend]
        bootstrap = None
        if role == "prefill":
            bootstrap = free_port(url_host)
            argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
        if config.model_path:
            argv += ["--model-path", config.model_path]
        if shares[i] is not None and "--num-threads" not in config.engine_args:
            # the server pins each of its dp * tp scheduler processes to its own part of this share
            argv += ["--num-threads", str(max(1, len(shares[i]) // (dp * tp)))]
        # one budget over every server: each its even share (it splits that over its own ranks)
        argv += ["--mem-fraction-static", f"{config.mem_fraction_static / n_servers:.6g}"]
        if role == "decode" and config.local_prefill_max_tokens:
            argv += ["--max-local-prefill-tokens", str(config.local_prefill_max_tokens)]
        # the shared flags, with KV event ports of this server's own (event_ports.py)
        argv += with_own_event_ports(config.engine_args, url_host, dp)
        specs.append(ServerSpec(f"{role}-{idx}", tuple(argv), f"http://{url_host}:{port}", shares[i], bootstrap))
    router_port = config.port or free_port(url_host)
    argv = [python, "-m", "pdserve.router", "--host", config.host, "--port", str(router_port)]
    for s in specs:
        if s.bootstrap_port is not None:
            argv += ["--prefill", s.url, str(s.bootstrap_port)]
        else:
            argv += ["--decode", s.url]
    if config.local_prefill_max_tokens:
        argv += ["--local-prefill-max-tokens", str(config.local_prefill_max_tokens)]
    argv += list(config.router_args)
    specs.append(ServerSpec("router", tuple(argv), f"http://{url_host}:{router_port}"))
    return specs


KEY_FLAGS = ("--disaggregation-auth-key-file", "--disaggregation-allow-unauthenticated")


def with_kv_key(config: LaunchConfig, key_dir: str) -> LaunchConfig:
    """On a non-loopback host, servers refuse to start without a KV control-plane key: unless the
    flags name one (or the opt-out), a fresh random key, private to this launch (0600 in
    ``key_dir``), goes to every server it starts, the planner's included."""
    from pdserve.engine.net_allowlist import is_loopback

    if is_loopback(config.host) or any(a.split("=")[0] in KEY_FLAGS for a in config.engine_args):
        return config
    path = os.path.join(key_dir, "kv-auth.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex())
    return dataclasses.replace(config, engine_args=config.engine_args + ("--disaggregation-auth-key-file", path))


ADMIN_KEY_FLAGS = ("--admin-api-key", "--admin-api-key-file")


def with_admin_key(config: LaunchConfig, key_dir: str) -> LaunchConfig:
    """Off loopback, the control routes of the router and of the servers answer only with the admin
    key, and the router's control fan-out sends its own to the servers: unless the flags already
    name one (``--admin-api-key[-file]`` among the servers' or the router's flags) or the
    environment does, one fresh random key, private to this launch (0600 in ``key_dir``), goes to
    the router and every server as ``--admin-api-key-file`` (the planner's servers included, and the
    planner itself: ``router_admin_key_file``)."""
    from pdserve.engine import env
    from pdserve.engine.net_allowlist import is_loopback

    named = any(a.split("=")[0] in ADMIN_KEY_FLAGS for a in config.engine_args + config.router_args)
    if is_loopback(config.host) or named or env.PDSERVE_ADMIN_API_KEY or env.PDSERVE_ROUTER_ADMIN_API_KEY:
        return config
    path = os.path.join(key_dir, "admin-api.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex())
    flag = ("--admin-api-key-file", path)
    return dataclasses.replace(config, engine_args=config.engine_args + flag, router_args=config.router_args + flag)


def planner_args_with_admin_key(config: LaunchConfig) -> tuple[str, ...]:
    """``--planner-arg`` flags, plus the router's admin key (read from the file its flags name)
    unless they give one: the planner adds, drains and removes workers through the router's admin
    routes. The planner runs inside the launch process, so the key never shows in a process list."""
    from pdserve.engine.secret_files import read_key

    path = router_admin_key_file(config.router_args)
    if path is None or any(a.split("=")[0] == "--admin-api-key" for a in config.planner_args):
        return config.planner_args
    return config.planner_args + ("--admin-api-key", read_key("admin-api-key", None, path, ""))


def router_admin_key_file(router_args: tuple[str, ...]) -> str | None:
    """The file ``--admin-api-key-file`` names among the router's flags (either spelling), if any."""
    for i, arg in enumerate(router_args):
        name, eq, value = arg.partition("=")
        if name == "--admin-api-key-file":
            return value if eq else (router_args[i + 1] if i + 1 < len(router_args) else None)
    return None


def wants_managed_store(engine_args: tuple[str, ...]) -> bool:
    """``--hicache-storage-backend mooncake`` (either spelling) among the servers' flags, and no
    ``--hicache-storage-backend-extra-config`` naming a store already running."""
    args = " ".join(engine_args).replace("=", " ").split()
    backend = any(a == "--hicache-storage-backend" and b == "mooncake" for a, b in zip(args, args[1:]))
    return backend and "--hicache-storage-backend-extra-config" not in args
