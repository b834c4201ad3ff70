"""``pdserve launch``: a whole PD cluster on this machine with one command.

Starts N prefill servers (each with its own HTTP port and bootstrap port), M
decode servers and the router as subprocesses, each in its own process group
and writing its own log file; waits until every server answers /health and the
router reports every worker healthy; prints the public URL and an example
``curl``; then waits. Ctrl-C or SIGTERM stops every process it started (SIGTERM
to each process group, SIGKILL to what is left after a grace period), within
10 s. A server that exits early stops the others, its log's last lines are
printed and launch exits 1.

With ``--cpu-split auto`` each server is pinned (``os.sched_setaffinity`` in
the child, before it execs) to its own share of this process's cores, and its
torch threads are sized to that share: prefill and decode stop competing for
the same cores, which is the point of disaggregating on one box.

Flags that ``pdserve serve`` knows and launch does not (``--dtype``,
``--max-total-tokens``, ``--chunked-prefill-size``, ...) are passed to every
server unchanged; they are validated here first, so a typo fails before
anything starts.

    pdserve launch                                   # 1 prefill + 1 decode + router, default model
    pdserve launch --prefill 2 --decode 1 --cpu-split auto --max-total-tokens 4096

Memory: the servers share one budget, ``--mem-fraction-static F`` (default 0.25) of the host's
memory for every server's weights and KV pages together: each of the ``n`` servers gets
``--mem-fraction-static F/n``, which it splits over its own ranks (``pool_sizing``), so servers
started together never size their pools from what the others have not allocated yet.

``--local-prefill-max-tokens N`` turns conditional disaggregation on: the decode servers prefill
prompts of up to N uncached tokens themselves (``--max-local-prefill-tokens N``) and the router
sends them there alone (its ``--local-prefill-max-tokens N``).

``--planner`` runs the SLA planner over the cluster once it is ready (entrypoints/planner/launch_planner.py):
the ``local`` connector starts servers on demand with the same flags as launch's own, registers
them with the router, drains and stops them on scale-down; ``--planner-arg FLAG`` passes a
`pdserve planner` flag (``--profile``, SLOs, ``--max-decode``, ``--cooldown``, ``--budget``, ...);
``--planner-port`` is the planner's own /metrics. Stopping the cluster stops its servers too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.entrypoints.event_ports import with_own_event_ports
from pdserve.entrypoints.procs import STOP_GRACE_S, free_port, get_json, log_tail, spawn, stop_groups
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


class Cluster:
    """The processes of one launch: ``start()`` them, ``wait_ready()``, ``stop()``.

    ``make_planner`` (``pdserve.entrypoints.planner.launch_planner.launch_planner``, handed in by the CLI
    so that the launcher does not import the planner) builds the planner of ``--planner``."""

    def __init__(self, config: LaunchConfig, make_planner: Callable | None = None):
        self.make_planner = make_planner
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.config = config = with_kv_key(config, self.log_dir)
        self.specs = plan(config)
        self.procs: dict[str, subprocess.Popen] = {}
        # --hicache-storage-backend mooncake without an extra config: launch runs the store itself
        self.store = None
        if wants_managed_store(config.engine_args):
            from pdserve.entrypoints.mooncake_service import MooncakeService

            self.store = MooncakeService(self.log_dir, host="127.0.0.1")
            extra = ("--hicache-storage-backend-extra-config", json.dumps(self.store.extra_config()))
            self.specs = [s if s.name == "router" else dataclasses.replace(s, argv=s.argv + extra)
                          for s in self.specs]
        self.planner = None  # LaunchPlanner, once started (--planner)

    @property
    def url(self) -> str:
        return self.specs[-1].url

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _spawn(self, spec: ServerSpec) -> None:
        self.procs[spec.name] = spawn(spec.argv, self.log_path(spec.name), cpus=spec.cpus, die_with_parent=True)

    def start(self) -> None:
        if self.store is not None:
            self.store.start()
            print(f"[launch] mooncake_master at {self.store.extra_config()['master_server_address']}, "
                  f"store memory {self.store.segment_size}", flush=True)
        for spec in self.specs[:-1]:
            self._spawn(spec)

    def dead(self) -> str | None:
        """Name of a started process that has exited, if any."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                return name
        return None

    def failure(self, name: str) -> LaunchError:
        p = self.procs[name]
        code = p.poll()
        how = f"exited with code {code}" if code is not None else "did not become healthy in time"
        return LaunchError(f"{name} {how}; last lines of {self.log_path(name)}:\n{log_tail(self.log_path(name))}")

    def wait_ready(self, stop_requested=lambda: False) -> bool:
        """Start the router once every server answers /health; return when the router
        reports every worker healthy (True), or False when a stop was requested first.
        Raises LaunchError when a process exits or the startup timeout passes."""
        deadline = time.monotonic() + self.config.startup_timeout
        pending = {s.name: s for s in self.specs[:-1]}
        router = self.specs[-1]
        want = {"prefill": self.config.prefill, "decode": self.config.decode}
        while True:
            if stop_requested():
                return False
            name = self.dead()
            if name is not None:
                raise self.failure(name)
            for n, spec in list(pending.items()):
                if get_json(spec.url + "/health") is not None:
                    print(f"[launch] {n} healthy at {spec.url}", flush=True)
                    del pending[n]
            if not pending and "router" not in self.procs:
                self._spawn(router)
            if "router" in self.procs:
                h = get_json(router.url + "/health")
                counts = (h or {}).get("healthy_endpoints") or {}
                if h is not None and all(counts.get(r, 0) >= k for r, k in want.items()):
                    return True
            if time.monotonic() > deadline:
                slow = next(iter(pending), "router")
                raise self.failure(slow)
            time.sleep(0.25)

    def planner_serve_args(self) -> tuple[str, ...]:
        """`pdserve serve` flags of the servers the planner adds: those of launch's own servers."""
        c = self.config
        args = ["--dp-size", str(c.prefill_dp), "--tp-size", str(c.prefill_tp),
                "--mem-fraction-static", f"{c.mem_fraction_static / (c.prefill + c.decode):.6g}"]
        if c.model_path:
            args += ["--model-path", c.model_path]
        args += list(c.engine_args)
        if self.store is not None:
            args += ["--hicache-storage-backend-extra-config", json.dumps(self.store.extra_config())]
        return tuple(args)

    def start_planner(self, stop_requested=lambda: False) -> bool:
        """--planner: start the planner over the ready cluster; True once it serves its /metrics,
        False on a stop request; LaunchError when it cannot start (e.g. a profile of another
        configuration)."""
        c = self.config
        if self.make_planner is None:
            raise LaunchError("--planner: no planner was handed to this launcher")
        try:
            self.planner = self.make_planner(c.planner_args, self.url, c.planner_port, c.host,
                                             self.planner_serve_args(), c.transfer_backend, self.log_dir,
                                             c.startup_timeout)
            self.planner.start()
            return self.planner.wait_ready(120.0, stop_requested)
        except (ValueError, RuntimeError) as e:
            raise LaunchError(f"planner: {e}; log {self.log_path('planner')}") from e

    def stop(self) -> None:
        """SIGTERM every process group (the planner's servers too), SIGKILL what is left after the
        grace period, and return once no process of any group is alive."""
        names = {p.pid: name for name, p in self.procs.items()}
        procs = list(self.procs.values())
        if self.planner is not None:
            added = self.planner.stop()
            names.update({p.pid: f"planner server {p.pid}" for p in added})
            procs += added
        for p in stop_groups(procs, self.config.stop_grace):
            print(f"[launch] {names[p.pid]} did not stop within {self.config.stop_grace:g} s: SIGKILL", flush=True)
        if self.store is not None:  # after the servers, whose store clients say goodbye to the master
            self.store.stop()


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


def wants_managed_store(engine_args: tuple[str, ...]) -> bool:
    """``--hicache-storage-backend mooncake`` (either spelling) among the servers' flags, and no
    ``--hicache-storage-backend-extra-config`` naming a store already running."""
    args = " ".join(engine_args).replace("=", " ").split()
    backend = any(a == "--hicache-storage-backend" and b == "mooncake" for a, b in zip(args, args[1:]))
    return backend and "--hicache-storage-backend-extra-config" not in args


def banner(cluster: Cluster) -> str:
    models = (get_json(cluster.url + "/v1/models", timeout=5.0) or {}).get("data") or [{}]
    model = models[0].get("id") or "default"
    lines = ["", f"pdserve cluster ready: {cluster.url}"]
    for s in cluster.specs:
        extra = f" bootstrap port {s.bootstrap_port}" if s.bootstrap_port else ""
        cpus = f" cpus {list(s.cpus)}" if s.cpus else ""
        lines.append(f"  {s.name:<10} {s.url}{extra}{cpus}  pid {cluster.procs[s.name].pid}")
    if cluster.planner is not None and cluster.planner.port is not None:
        host = cluster.url.rsplit(":", 1)[0]
        lines.append(f"  planner    {host}:{cluster.planner.port}/metrics  (servers it adds: "
                     f"{cluster.log_dir}/planner-*.log)")
    lines.append(f"  logs in {cluster.log_dir}")
    lines += [
        "",
        "try:",
        f"  curl -s {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        "    -d '" + json.dumps({"model": model, "max_tokens": 32,
                              "messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "'",
        "",
        "Ctrl-C stops the cluster.",
    ]
    return "\n".join(lines)


def run_launch(config: LaunchConfig, make_planner: Callable | None = None) -> int:
    """Start the cluster, serve until SIGINT/SIGTERM, stop it. 0 on a clean stop, 1 if a process failed."""
    stop_signal: list[int] = []

    def on_signal(signum, _frame) -> None:
        stop_signal.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = Cluster(config, make_planner)
    print(f"[launch] logs in {cluster.log_dir}", flush=True)
    code = 0
    try:
        cluster.start()
        ready = cluster.wait_ready(lambda: bool(stop_signal))
        if ready and config.planner:
            ready = cluster.start_planner(lambda: bool(stop_signal))
        if ready:
            print(banner(cluster), flush=True)
            while not stop_signal:
                name = cluster.dead()
                if name is not None:
                    raise cluster.failure(name)
                why = cluster.planner.failed() if cluster.planner is not None else None
                if why:
                    print(f"[launch] the planner stopped ({why}); the cluster serves on as it is", flush=True)
                time.sleep(0.2)
        print(f"[launch] {signal.Signals(stop_signal[0]).name}: stopping", flush=True)
    except LaunchError as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        t = time.monotonic()
        cluster.stop()
        print(f"[launch] stopped in {time.monotonic() - t:.1f} s", flush=True)
        for s, h in old.items():
            signal.signal(s, h)
    return code
