"""A prefill rank's entry in its bootstrap server: how decode ranks find it (SGLang's
``_register_to_bootstrap``).

Life cycle: at the manager's start a thread ``PUT``s the rank's ``RankRegistration`` (its control
endpoint, KV layout, backend and TP place) to the bootstrap server of the same prefill server,
retrying while that server is not up yet, up to a deadline; ``registered`` is set once it is done,
with ``error`` saying why it failed (a 400 is final, never retried). The entry lives as long as
the bootstrap server; decode ranks read it through ``bootstrap_client``.

Owns that thread, its outcome and nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error

import pdserve.kvtransfer.messages as m
from pdserve.engine.kv_auth import FrameAuth
from pdserve.kvtransfer.bootstrap_client import register_rank

logger = logging.getLogger(__name__)

RETRY_S = 0.2


class BootstrapRegistration:
    def __init__(self, host: str, port: int, reg: m.RankRegistration, auth: FrameAuth | None, deadline_s: float,
                 stop: threading.Event):
        """``deadline_s``: how long to keep trying to reach the server; ``stop``: the manager closed."""
        self.host = host
        self.port = port
        self.reg = reg
        self.auth = auth
        self.deadline_s = deadline_s
        self._stop = stop
        self.registered = threading.Event()  # set once the attempt ended (``error`` None: accepted)
        self.error: str | None = None
        self._thread = threading.Thread(target=self.run, name="kv-bootstrap-reg", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.deadline_s
        where = f"{self.host}:{self.port}"
        while not self._stop.is_set():
            try:
                register_rank(self.host, self.port, self.reg, self.auth)
                self.registered.set()
                return
            except urllib.error.HTTPError as e:
                # a 400 will not get better by retrying
                self.error = f"bootstrap server rejected rank: {e.read().decode(errors='replace')}"
                logger.error("kv prefill: %s", self.error)
                self.registered.set()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    self.error = f"bootstrap server {where} unreachable: {e}"
                    logger.error("kv prefill: %s", self.error)
                    self.registered.set()
                    return
                self._stop.wait(RETRY_S)
