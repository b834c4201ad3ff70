"""The limits every HTTP front shares: the engine server's, its KV bootstrap server's, the router's
and the planner's.

A request body larger than ``MAX_REQUEST_BYTES`` is answered 413 by an engine server
(``--max-request-bytes``), so the router's default ``--max-payload-size`` is the same number: a
body the workers would refuse is refused before the router reads it.

``HttpLimits`` bounds what a client that never finishes a request can hold: the time a connection
may stay without a whole request head (``--http-header-timeout``; slowloris, and idle keep-alive
connections) and the number of connections one listener keeps open (``--max-connections``).
``engine/http_site.py`` enforces both. The defaults are generous: the header timeout outlasts the
router's own 60 s keep-alive to its workers (so the router, not the worker, closes an idle pooled
connection), and the cap sits above the concurrency a large benchmark drives.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REQUEST_BYTES = 8 * 1024 * 1024
HTTP_READ_TIMEOUT = 60.0  # seconds a request body may take to arrive (then 408)
HTTP_HEADER_TIMEOUT = 75.0  # seconds; nginx's keep-alive default, above the router's pooled 60 s
MAX_CONNECTIONS = 8192


@dataclass(frozen=True)
class HttpLimits:
    """What one listener allows a connection: ``header_timeout`` seconds from its start, and from
    each answer, to a whole request head; at most ``max_connections`` open at once."""

    header_timeout: float = HTTP_HEADER_TIMEOUT
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self):
        if not self.header_timeout > 0:
            raise ValueError(f"http_header_timeout must be > 0, got {self.header_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
