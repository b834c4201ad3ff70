"""Child processes: start one in its own process group with its output in a log file, stop
the group, pick a free port, wait until a server answers ``/health``.

The one owner of this for ``pdserve launch`` (``entrypoints/cluster.py``, its supervisor), the benchmark scripts
and the test stands. A pdserve server starts scheduler ranks of its own, so a stop signals
the whole process group (the child is started in a new session: its pid is the group id)
and waits until no process of the group is left, not only the one it started.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence

LOG_TAIL_LINES = 40
STOP_GRACE_S = 6.0  # SIGTERM to SIGKILL: a server stops its ranks and closes its KV transfer engine in ~1-2 s

# Binding port 0 and closing returns a port that is free now, but from the kernel's ephemeral
# range: until the server binds it (seconds, while it loads the model), any outbound connection
# on the machine can take it as its local port, and the server fails with "address already in
# use" (seen in CI: a prefill's HTTP port). So ports are drawn at random from below the ephemeral
# range, where the kernel never assigns one, and above the band Mooncake's transfer engine draws
# its own listening ports from (seen: 15000-18000); each is checked free by binding it. A port is
# never handed out twice by one process: a later call could otherwise return one not yet bound.
_PORT_BAND_LOW = 20000
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, outside the kernel's ephemeral range, and not returned
    before by this process."""
    high = _ephemeral_low() - 1
    with _handed_out_lock:
        if high - _PORT_BAND_LOW >= 1000:
            for _ in range(200):
                port = _rng.randint(_PORT_BAND_LOW, high)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        while True:  # no room below the ephemeral range: fall back to the kernel's choice
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def free_port_run(host: str = "127.0.0.1", n: int = 1) -> int:
    """The first of ``n`` consecutive ports free on ``host`` now (``free_port``'s rules), all of
    them handed out."""
    for _ in range(200):
        port = free_port(host)
        rest = range(port + 1, port + n)
        with _handed_out_lock:
            if all(p not in _handed_out and _bindable(host, p) for p in rest):
                _handed_out.update(rest)
                return port
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def get_json(url: str, timeout: float = 1.0) -> dict | None:
    """The JSON body of a 200 answer to GET ``url`` ({} when it is empty or not JSON); None when
    there is no 200 answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status != 200:
                return None
            body = r.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        return json.loads(body) if body else {}
    except ValueError:
        return {}


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 300.0, *,
                 name: str | None = None, log: Callable[[], str] | None = None, period: float = 0.25) -> None:
    """Poll ``url``/health until it answers 200. Raises RuntimeError (with ``log()``) when ``proc``
    exits first, TimeoutError after ``timeout`` seconds."""
    name = name or url
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}" + (f":\n{log()}" if log else ""))
        if get_json(url + "/health") is not None:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not healthy within {timeout:g} s" + (f":\n{log()}" if log else ""))
        time.sleep(period)


def log_tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a log file."""
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(lines[-n:])


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# looked up once, in the parent: a child between fork and exec should not dlopen (a lock
# another thread of the parent held at fork time would never be released there)
_PRCTL = _load_prctl()


def set_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) on Linux; nothing elsewhere. Safe in a preexec_fn."""
    if _PRCTL is not None:
        _PRCTL(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def spawn(argv: Sequence[str], log_path: str | os.PathLike, *, env: dict[str, str] | None = None,
          cwd: str | os.PathLike | None = None, cpus: Sequence[int] | None = None,
          die_with_parent: bool = False) -> subprocess.Popen:
    """Start ``argv`` in a new session (its own process group), stdout and stderr appended to
    ``log_path`` after a ``$ argv`` line. ``cpus``: the child (and what it starts) runs on these
    cores only. ``die_with_parent``: the child gets SIGTERM when this process dies, even by
    SIGKILL, so that no server outlives its launcher."""
    parent = os.getpid()

    def in_child() -> None:
        if die_with_parent:
            set_parent_death_signal(signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the line above
                os._exit(1)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(argv) + (f"   # cpus {list(cpus)}" if cpus else "") + "\n").encode())
        log.flush()
        return subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True, close_fds=True,
            preexec_fn=in_child if (die_with_parent or cpus is not None) else None,
        )


def group_pids(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of process group ``pgid`` (Linux /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()  # after "(comm) ": state ppid pgrp ...
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            pids.append(int(entry))
    return pids


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of a child started by ``spawn`` (no wait)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop_groups(procs: Iterable[subprocess.Popen], grace: float = STOP_GRACE_S,
                sig: int = signal.SIGTERM) -> list[subprocess.Popen]:
    """Send ``sig`` to the groups of ``procs`` (children started by ``spawn``) together, SIGKILL
    what is left after ``grace`` seconds, and return once no process of any group is alive (two
    seconds more at most). Returns the children whose group needed SIGKILL."""
    procs = list(procs)
    for p in procs:
        signal_group(p, sig)
        signal_group(p, signal.SIGCONT)  # a stopped group (tests SIGSTOP one) handles the signal once continued
    _wait_groups_gone(procs, grace)
    killed = [p for p in procs if group_pids(p.pid)]
    for p in killed:
        signal_group(p, signal.SIGKILL)
    _wait_groups_gone(procs, 2.0)
    return killed


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> bool:
    """``stop_groups`` of one child; True when it stopped within the grace period."""
    return not stop_groups([proc], grace, sig)


def _wait_groups_gone(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.poll()  # reap our own children, so that they do not linger as zombies
        if not any(group_pids(p.pid) for p in procs) or time.monotonic() > deadline:
            return
        time.sleep(0.05)
