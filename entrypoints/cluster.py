"""``pdserve launch``'s supervisor: the processes of one planned cluster, started, watched
until ready, and stopped (see ``launch.py`` for the command as a whole, ``launch_plan.py`` for
what it starts)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable

from pdserve.entrypoints.launch_plan import (CPU_SPLITS, KEY_FLAGS, LaunchConfig, LaunchError, ServerSpec, plan,
                                             planner_args_with_admin_key, split_cpus, wants_managed_store,
                                             with_admin_key, with_kv_key)
from pdserve.entrypoints.procs import free_port, get_json, log_tail, spawn, stop_groups

# the plan's names, importable from here as before
__all__ = ["CPU_SPLITS", "KEY_FLAGS", "Cluster", "LaunchConfig", "LaunchError", "ServerSpec", "banner", "free_port",
           "plan", "split_cpus", "wants_managed_store", "with_kv_key"]


class Cluster:
    """The processes of one launch: ``start()`` them, ``wait_ready()``, ``stop()``.

    ``make_planner`` (``pdserve.entrypoints.planner.launch_planner.launch_planner``, handed in by the CLI
    so that the launcher does not import the planner) builds the planner of ``--planner``."""

    def __init__(self, config: LaunchConfig, make_planner: Callable | None = None):
        self.make_planner = make_planner
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.config = config = with_admin_key(with_kv_key(config, self.log_dir), self.log_dir)
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
            self.planner = self.make_planner(planner_args_with_admin_key(c), self.url, c.planner_port, c.host,
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
