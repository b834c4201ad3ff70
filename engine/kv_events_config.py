"""``--kv-events-config``: where a server publishes its KV cache events.

The flag takes the JSON object SGLang and vLLM take (``{"publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": "kv", "replay_endpoint": "tcp://*:5558"}``),
so an operator's command line moves between them. As in vLLM, DP rank ``r``
publishes on the endpoint's port + ``r`` (ipc/inproc endpoints get ``_dp<r>``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.engine.json_flags import json_object

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "null"  # "null": no events
    endpoint: str = "tcp://*:5557"  # PUB socket, bound
    replay_endpoint: str | None = None  # ROUTER socket for replays, bound; None: no replay
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB send high-water mark (messages); beyond it slow subscribers lose batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it new ones drop
    # vLLM's switch; accepted so its JSON works here, and "publisher" alone decides
    enable_kv_cache_events: bool = True

    def __post_init__(self):
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be >= 1, got {getattr(self, name)}")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and "://" not in ep:
                raise ValueError(f"kv events endpoint must look like tcp://host:port, got {ep!r}")

    @property
    def enabled(self) -> bool:
        return self.publisher != "null" and self.enable_kv_cache_events

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig:
        """Parse the flag's JSON (None or empty: events off); ValueError names a bad key or value."""
        if not text:
            return cls()
        obj = json_object(text, "kv_events_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**obj)


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint DP rank ``dp_rank`` binds: tcp port + rank, other transports ``_dp<rank>``."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::")


def connect_endpoint(endpoint: str, host: str) -> str:
    """The address a subscriber connects to: a wildcard bind host replaced by ``host``."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint[len(wildcard):]}"
    return endpoint


def bind_endpoint(endpoint: str, host: str) -> str:
    """Where a rank binds: a wildcard endpoint binds the server's ``host`` (``--host``), unless that
    is a wildcard too; an explicit endpoint host is the operator's choice and stays."""
    return endpoint if host in WILDCARD_HOSTS else connect_endpoint(endpoint, host)


def advertised_endpoints(config: KVEventsConfig, dp_size: int, host: str) -> list[dict]:
    """What ``/server_info`` tells a router: per DP rank, where to subscribe and ask for replays."""
    if not config.enabled:
        return []
    out = []
    for r in range(dp_size):
        replay = config.replay_endpoint
        out.append({
            "dp_rank": r,
            "endpoint": connect_endpoint(rank_endpoint(config.endpoint, r), host),
            "replay_endpoint": connect_endpoint(rank_endpoint(replay, r), host) if replay else None,
            "topic": config.topic,
        })
    return out
