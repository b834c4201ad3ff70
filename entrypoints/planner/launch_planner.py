"""The planner of ``pdserve launch --planner``: the SLA planner with the ``local`` connector over the
cluster launch started, run in a thread of the launch process (its own asyncio loop).

Why in-process: launch owns every process of the cluster, and stopping the cluster must stop the
servers the planner added too. The planner runs with ``leave_servers`` (its clean exit does not
drain them: the router is about to go as well), and ``stop`` hands back their processes so that
launch stops them with its own. A planner that fails while the cluster serves is reported and
leaves the cluster as it is (its servers keep serving); one that fails before it is ready (a
profile of another configuration, a bad flag) fails the launch.

Servers the planner starts get the same ``pdserve serve`` flags as launch's own (model, DP and TP
size, the same ``--mem-fraction-static`` share, every flag passed on to servers); they are not
pinned by ``--cpu-split auto``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
from collections.abc import Callable

from pdserve.entrypoints.planner.planner_config import PlannerConfig

# flags of `pdserve planner` that launch sets itself
OWNED_PLANNER_FLAGS = ("--router", "--connector", "--log-dir", "--transfer-backend", "--leave-servers",
                       "--startup-timeout", "--host", "--port")


def launch_planner(planner_args: tuple[str, ...], router: str, port: int, host: str, serve_args: tuple[str, ...],
                   transfer_backend: str, log_dir: str, startup_timeout: float) -> "LaunchPlanner":
    """The (not yet started) planner of a launch; ValueError on a bad ``--planner-arg``. Handed to
    ``pdserve launch`` by the CLI (the launcher itself does not import the planner)."""
    config = planner_config(planner_args, router, port, host, serve_args, transfer_backend, log_dir, startup_timeout)
    return LaunchPlanner(config, os.path.join(log_dir, "planner.log"))


def planner_config(planner_args: tuple[str, ...], router: str, port: int, host: str, serve_args: tuple[str, ...],
                   transfer_backend: str, log_dir: str | None, startup_timeout: float) -> PlannerConfig:
    """The PlannerConfig of ``pdserve launch --planner``: ``planner_args`` are `pdserve planner`
    flags (``--profile``, SLOs, ``--min/--max-prefill/decode``, ``--cooldown``, ``--budget``, ...);
    ValueError naming a flag that launch sets itself or an unknown one."""
    from pdserve.entrypoints.planner.cli import build_planner_parser, planner_values

    for flag in planner_args:
        name = flag.split("=")[0]
        if name in OWNED_PLANNER_FLAGS:
            raise ValueError(f"--planner-arg {name} is set by launch itself")
    parser = build_planner_parser()
    ns, rest = parser.parse_known_args(list(planner_args) + ["--router", router, "--connector", "local"])
    if rest:
        raise ValueError(f"--planner-arg: not a `pdserve planner` flag: {' '.join(rest)}")
    kw = planner_values(ns)
    kw.update(host=host, port=port, log_dir=log_dir, transfer_backend=transfer_backend,
              startup_timeout=startup_timeout, leave_servers=True)
    return PlannerConfig(serve_args=tuple(serve_args), **kw)


class LaunchPlanner:
    """``start()`` the planner thread, ``wait_ready()``, ``stop()`` (returns the processes of the
    servers it started that are still to be stopped)."""

    def __init__(self, config: PlannerConfig, log_path: str):
        self.config = config
        self.log_path = log_path
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.process = None  # the PlannerProcess, once ready
        self.port: int | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.done = threading.Event()
        self.handler: logging.Handler | None = None
        self.saved_logger = (logging.NOTSET, True)

    def _attach_log(self) -> None:
        """The planner's log lines go to ``log_path`` only (until ``stop``)."""
        self.handler = logging.FileHandler(self.log_path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger("pdserve.planner")
        self.saved_logger = (logger.level, logger.propagate)
        logger.addHandler(self.handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    def _detach_log(self) -> None:
        if self.handler is not None:
            logger = logging.getLogger("pdserve.planner")
            logger.removeHandler(self.handler)
            self.handler.close()
            logger.setLevel(self.saved_logger[0])
            logger.propagate = self.saved_logger[1]
            self.handler = None

    def _run(self) -> None:
        from pdserve.entrypoints.planner.planner_process import serve_planner

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()

            def on_ready(process, port) -> None:
                self.process, self.port = process, port
                self.ready.set()

            await serve_planner(self.config, self.stop_event, on_ready=on_ready)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by launch; the cluster keeps serving
            self.error = e
            logging.getLogger("pdserve.planner").exception("the planner failed")
        finally:
            self.done.set()
            self.ready.set()

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._attach_log()
        self.thread = threading.Thread(target=self._run, name="pdserve-planner", daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float, stop_requested: Callable[[], bool] = lambda: False) -> bool:
        """True once the planner serves its /metrics; False on a stop request; RuntimeError when
        it failed to start or did not become ready within ``timeout``."""
        waited = 0.0
        while not self.ready.wait(0.25):
            waited += 0.25
            if stop_requested():
                return False
            if waited > timeout:
                raise RuntimeError(f"the planner did not start within {timeout:g} s (log {self.log_path})")
        if self.error is not None:
            raise RuntimeError(f"the planner failed to start: {type(self.error).__name__}: {self.error}")
        return True

    def failed(self) -> str | None:
        """Why the planner stopped while the cluster runs, once (None while it runs)."""
        if self.done.is_set() and self.error is not None:
            e, self.error = self.error, None
            return f"{type(e).__name__}: {e}"
        return None

    def stop(self, timeout: float = 10.0) -> list[subprocess.Popen]:
        """Stop the planner loop; the processes of the servers it started, for launch to stop."""
        if self.loop is not None and self.stop_event is not None and not self.done.is_set():
            try:
                self.loop.call_soon_threadsafe(self.stop_event.set)
            except RuntimeError:  # the loop already closed
                pass
        if self.thread is not None:
            self.thread.join(timeout)
        self._detach_log()
        conn = getattr(self.process, "connector", None)
        servers = list(getattr(conn, "servers", ()))
        return [s.proc for s in servers if s.proc.poll() is None]
