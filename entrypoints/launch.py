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

import signal
import sys
import time
from collections.abc import Callable

from pdserve.entrypoints.cluster import Cluster, banner
from pdserve.entrypoints.launch_plan import LaunchConfig, LaunchError


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
