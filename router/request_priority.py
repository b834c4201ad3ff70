"""A request's priority at the router: the ``x-pdserve-priority`` header.

The router orders its queue before it reads a body (the admission slot is taken first, so queued
uploads wait outside memory), so the priority it queues by comes from the header. An integer in
SGLang's meaning: with ``--schedule-low-priority-values-first`` smaller values go first, else
larger ones. Without ``--enable-priority-scheduling`` the header is refused (400) rather than
ignored, so a client never believes it is being prioritised when it is not.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.router.errors import bad_request

PRIORITY_HEADER = "x-pdserve-priority"
PRIORITY_LIMIT = 2**31 - 1  # an int32, as SGLang's field


def request_priority(headers: Mapping[str, str], enabled: bool) -> int:
    """The request's priority (0 without the header); a 400 RouterError for a bad value."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0
    if not enabled:
        raise bad_request(f"header {PRIORITY_HEADER} needs a router started with "
                          "--enable-priority-scheduling", PRIORITY_HEADER)
    try:
        value = int(raw.strip())
    except ValueError:
        raise bad_request(f"header {PRIORITY_HEADER} must be an integer, got {raw[:40]!r}",
                          PRIORITY_HEADER) from None
    if abs(value) > PRIORITY_LIMIT:
        raise bad_request(f"header {PRIORITY_HEADER} must be within +-{PRIORITY_LIMIT}", PRIORITY_HEADER)
    return value
