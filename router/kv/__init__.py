"""pdserve.router.kv: KV-aware routing: the prefix tree, the KV event index and its subscriber, cache tiers, and the policies that score workers by cached prefix."""
