"""The KV-memory level: the page pool, the prefix caches over it and their tiers (host memory,
storage), KV cache events and the forward batch.

The scheduler, the model executor, the attention backends and kvtransfer all import it; it imports
nothing above the base modules of ``pdserve.engine``.
"""
