"""The router health checker's changes of rotation, read back from its log records."""

from __future__ import annotations

from pdserve.router.workers import health

ROTATION_FORMAT = "%s worker %s is %s (%s probe)"  # health.HealthChecker.check's log line


def rotation_changes(records) -> list[tuple[str, str, str]]:
    """``(role, change, probe kind)`` of each change of rotation in ``records`` (caplog's), in order."""
    out = []
    for rec in records:
        if rec.name == health.log.name and rec.msg == ROTATION_FORMAT:
            role, _url, change, kind = rec.args
            assert kind in health.PROBE_KINDS, kind
            out.append((role, change, kind))
    return out
