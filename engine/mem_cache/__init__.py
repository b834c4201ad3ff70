"""The KV-memory level: the KV pool, the prefix caches over it and their tiers (host memory, storage)."""
