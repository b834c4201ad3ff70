"""Body-size limits shared by every HTTP front: the engine server's and the router's.

A request body larger than ``MAX_REQUEST_BYTES`` is answered 413 by an engine server
(``--max-request-bytes``), so the router's default ``--max-payload-size`` is the same number: a
body the workers would refuse is refused before the router reads it.
"""

from __future__ import annotations

MAX_REQUEST_BYTES = 8 * 1024 * 1024
