"""The hierarchical cache's choices (SGLang's ``--hicache-*`` values), importable without torch."""

from __future__ import annotations

from pdserve.engine.mem_cache import storage_backend

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
STORAGE_BACKENDS = tuple(storage_backend.STORAGE_BACKENDS)  # the registry's names
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def check_hicache(enable: bool, ratio: float, size_gb: float, write_policy: str, disable_radix_cache: bool,
                  storage_backend: str | None = None, prefetch_policy: str = "timeout") -> None:
    """Raise ValueError naming the bad ``hicache_*`` field."""
    if storage_backend is not None and storage_backend not in STORAGE_BACKENDS:
        raise ValueError(f"hicache_storage_backend must be one of {STORAGE_BACKENDS}, got {storage_backend!r}")
    if storage_backend is not None and not enable:
        raise ValueError("hicache_storage_backend is the tier under the host tier: it needs "
                         "enable_hierarchical_cache")
    if prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(f"hicache_storage_prefetch_policy must be one of {PREFETCH_POLICIES}, "
                         f"got {prefetch_policy!r}")
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    if ratio <= 1.0:
        raise ValueError(f"hicache_ratio must be > 1 (the host tier is larger than the KV pool), got {ratio}")
    if size_gb < 0:
        raise ValueError(f"hicache_size must be >= 0 GiB (0: use hicache_ratio), got {size_gb}")
    if enable and disable_radix_cache:
        raise ValueError("enable_hierarchical_cache tiers the radix cache: drop disable_radix_cache")
