"""One leg of one attempt failed: a typed value that the retry loop (router/pd_proxy.py) and the
migrating relay (router/migration/migrating_relay.py) decide on."""

from __future__ import annotations

from pdserve.router.workers.worker_registry import Endpoint


class LegFailure(Exception):
    """One leg of one attempt failed: a typed value the retry loop decides on."""

    def __init__(self, leg: str, endpoint: Endpoint, message: str, status: int | None = None,
                 body: bytes | None = None, content_type: str | None = None, cause: str | None = None):
        """``cause``: what /metrics counts the retry it causes under (``pdserve_router_retries_by_cause``);
        default: ``http_<status>``."""
        super().__init__(message)
        self.leg, self.endpoint, self.message = leg, endpoint, message
        self.status, self.body, self.content_type = status, body, content_type
        self.cause = cause or f"http_{status}"

    @property
    def retryable(self) -> bool:
        # a client error (bad request) would fail on any pair; pass it through instead
        return self.status is None or self.status >= 500 or self.status in (408, 429)

    def describe(self) -> str:
        return f"{self.leg} worker {self.endpoint.key}: {self.message}"
