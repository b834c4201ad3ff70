"""A decode whose prefill server misses a rank (one that registered elsewhere, or never) fails the
room within the bootstrap timeout with the bootstrap server's reason, not a bare 'unreachable'."""

from __future__ import annotations

import time

from pdserve.decode.prefill_dp_sizes import PrefillDPSizes
from pdserve.kvtransfer.bootstrap_server import BootstrapServer


def test_missing_prefill_rank_is_named_within_the_timeout():
    server = BootstrapServer("127.0.0.1", 0, tp_size=2).start_in_thread()  # nobody registers
    sizes = PrefillDPSizes(timeout=1.0)
    try:
        t0 = time.monotonic()
        while (got := sizes.get("127.0.0.1", server.port)) is None:
            assert time.monotonic() - t0 < 60, "no answer after the timeout"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= 1.0  # it waited out the timeout (load only adds to it)
        assert isinstance(got, str) and "HTTP 503: " in got and "0 of 2 prefill ranks registered" in got, got
        assert "missing" in got
    finally:
        sizes.close()
        server.stop_thread()
