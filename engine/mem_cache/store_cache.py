"""The hierarchical cache with a storage tier (L3) under the host tier: pages shared by servers.

``StoreHiRadixCache`` is the two-tier ``HiRadixCache`` plus a ``StorageWorker``:

- Write: every page that gets a host copy (by the write policy) is also put in
  the store under its namespaced chained hash (``storage_key``), once per page
  per process, sealed with its token hash and a checksum (``storage_object``).
  The namespace follows weight updates (``set_namespace``).
- Prefetch: when a request is queued (``start_prefetch``), the pages of its
  prompt past what the tree holds in any tier are fetched by the worker, while
  the request waits (for the queue, or in PD for the decode's destination).
  A finished fetch becomes host-only nodes below the tree's path, and the
  request's match then loads them into the pool like any host page.
- Prefetch policy (SGLang's ``--hicache-storage-prefetch-policy``): how long a
  request at the head of the queue waits for its prefetch. ``best_effort``:
  not at all (what arrived is used); ``wait_complete``: until it finished;
  ``timeout`` (the default): until it finished or its deadline passed. The
  deadline follows the tier costs (``prefetch_rule``: as long as computing the
  pages would take, when a fetch is cheaper than that, else none), unless the
  extra config sets SGLang's ``prefetch_timeout_base`` +
  ``prefetch_timeout_per_ki_token`` (seconds, per 1024 prompt tokens).
- A prefetch outliving its request is cancelled (``cancel_prefetch``); its
  result, if it comes, is dropped without taking host slots.
- A fetched chain attaches only where the tree still holds its ancestors: if
  they were evicted meanwhile, the pages are dropped (the match recomputes).
- LoRA: a page computed under an adapter is put and fetched under its adapter's namespace too
  (``storage_key.adapter_namespace``, known once ``name_adapter`` named the adapter: at start
  for ``--lora-paths``, at ``/load_lora_adapter`` for the others), with its chain hashed under
  the adapter's salt; a prefetch for a request under an adapter asks for that adapter's pages
  only. A page of an adapter never named is neither put nor fetched.
- KV events: a page the worker took to put is ``BlockStored`` "STORAGE" (once per
  page per process; the store's own evictions are not seen, so none is removed);
  a fetched page that became a host node is ``BlockStored`` "CPU".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdserve.engine.mem_cache.hiradix_cache import HiRadixCache, HiTreeNode
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.prefetch_rule import TierCosts
from pdserve.engine.mem_cache.radix_cache import cache_key
from pdserve.engine.mem_cache.storage_key import adapter_namespace, page_key
from pdserve.engine.mem_cache.storage_worker import FetchResult, StorageWorker
from pdserve.engine.mem_cache.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, block_hashes
from pdserve.engine.mem_cache.page_pool import PagePool

MAX_REMEMBERED_PUTS = 1 << 20  # hashes known to be stored; the set restarts empty past this


@dataclass
class _Prefetch:
    token_ids: list[int]
    started: float
    deadline: float
    done: bool = False


class StoreHiRadixCache(HiRadixCache):
    def __init__(self, pool: PagePool, host: HostKVPool, write_policy: str, storage: StorageWorker,
                 namespace: str, prefetch_policy: str = "timeout", extra: dict | None = None):
        super().__init__(pool, host, write_policy)
        self.storage = storage
        self.namespace = namespace
        self.prefetch_policy = prefetch_policy
        extra = extra or {}
        # SGLang's fixed timeout, when the extra config sets it; else the tier costs' rule decides
        self.fixed_timeout = "prefetch_timeout_base" in extra or "prefetch_timeout_per_ki_token" in extra
        self.timeout_base = float(extra.get("prefetch_timeout_base", 1.0))
        self.timeout_per_ki_token = float(extra.get("prefetch_timeout_per_ki_token", 0.25))
        self.costs = TierCosts()
        self._put: set[int] = set()
        self._adapters: dict[int, str] = {}  # lora_id -> its adapter_namespace
        self._prefetches: dict[str, _Prefetch] = {}
        self.prefetch_outcomes = {"complete": 0, "timeout": 0, "best_effort": 0, "cancelled": 0}

    # ------------------------------------------------------------------ write
    def _backup(self, nodes):
        super()._backup(nodes)
        sent = []  # for the KV events: the puts the worker took (not dropped by its breaker or queue)
        for n in nodes:
            if n.host is not None and n.hash not in self._put:
                key = self._page_key(n.lora_id, n.hash)
                if key is None:
                    continue
                if len(self._put) >= MAX_REMEMBERED_PUTS:
                    self._put.clear()
                self._put.add(n.hash)
                # a copy: the slot may be reused before the worker sends it
                data = self.host.slot_bytes_view(n.host).numpy().tobytes()
                dropped = self.storage.stats.dropped_puts
                self.storage.submit_put(key, n.hash, data)
                if self.storage.stats.dropped_puts == dropped:
                    sent.append(n)
        self._record_stored(sent, MEDIUM_STORAGE)

    def name_adapter(self, lora_id: int, path: str) -> None:
        """Adapter ``lora_id`` is read from ``path``: its pages' keys take its namespace."""
        ns = adapter_namespace(lora_id, path)
        if self._adapters.get(lora_id, ns) != ns:
            self._put.clear()  # retrained in place: its pages are not known stored under the new name
        self._adapters[lora_id] = ns

    def _page_key(self, lora_id: int, block_hash: int) -> str | None:
        """The store key of a page computed under ``lora_id`` (0: the base); None for an adapter
        never named (its pages stay out of the store)."""
        if not lora_id:
            return page_key(self.namespace, block_hash)
        adapter = self._adapters.get(lora_id)
        return None if adapter is None else page_key(self.namespace, block_hash, adapter)

    # --------------------------------------------------------------- prefetch
    def start_prefetch(self, rid, token_ids):
        lora_id = getattr(token_ids, "lora_id", 0)  # cache_key's: the request's adapter
        tokens = cache_key(list(token_ids[: len(token_ids) - 1]), lora_id)  # the last token is always computed
        num_pages = len(tokens) // self.page_size
        held = self._held_prefix(tokens, num_pages)
        if held >= num_pages or not self.storage.available:
            return
        if lora_id and lora_id not in self._adapters:  # an adapter never named: nothing of it is stored
            return
        hashes = block_hashes(tokens, self.page_size, lora_id)[held:num_pages]
        now = time.monotonic()
        if self.fixed_timeout:
            timeout = self.timeout_base + self.timeout_per_ki_token * len(tokens) / 1024
        else:
            timeout = self.costs.wait_s(len(hashes), self.page_size)
        self._prefetches[rid] = _Prefetch(tokens, now, now + timeout)
        self.storage.submit_fetch(rid, held, [self._page_key(lora_id, h) for h in hashes], hashes)

    def _held_prefix(self, tokens, num_pages: int) -> int:
        """Pages of ``tokens`` the tree holds in any tier."""
        node, n = self.root, 0
        for key in self._keys(tokens, num_pages):
            node = node.children.get(key)
            if node is None:
                break
            n += 1
        return n

    def prefetch_ready(self, rid):
        self.poll_storage()
        p = self._prefetches.get(rid)
        if p is None:
            return True
        if p.done or self.prefetch_policy == "best_effort":
            self.prefetch_outcomes["complete" if p.done else "best_effort"] += 1
        elif self.prefetch_policy == "timeout" and time.monotonic() >= p.deadline:
            self.prefetch_outcomes["timeout"] += 1
        else:
            return False
        del self._prefetches[rid]
        if not p.done:
            self.storage.cancel(rid)
        return True

    def wait_for_prefetch(self, rid, timeout):
        p = self._prefetches.get(rid)
        if p is None or p.done:
            return False
        if self.prefetch_policy == "timeout":
            timeout = min(timeout, max(0.0, p.deadline - time.monotonic()))
        self.storage.wait_fetched(timeout)
        return True

    def cancel_prefetch(self, rid):
        if self._prefetches.pop(rid, None) is not None:
            self.prefetch_outcomes["cancelled"] += 1
            self.storage.cancel(rid)

    def poll_storage(self) -> None:
        """Attach the fetches that finished (for requests still waiting) as host-only nodes."""
        for result in self.storage.drain():
            p = self._prefetches.get(result.rid)
            if p is None:
                continue  # its request was admitted (best effort, timeout) or ended
            p.done = True
            self.costs.observe_fetch(result.seconds, len(result.values))
            self._attach(p.token_ids, result)

    def _attach(self, tokens: list[int], result: FetchResult) -> None:
        keys = list(self._keys(tokens, result.start + len(result.values)))
        node = self.root
        path = []
        for key in keys[: result.start]:
            node = node.children.get(key)
            if node is None:
                return  # the chain's ancestors left the tree meanwhile
            path.append(node)
        todo = [(k, v) for k, v in zip(keys[result.start :], result.values)]
        self._loading = {id(n) for n in path}
        try:
            if len(todo) > self.host.num_free:
                self._evict_host(len(todo) - self.host.num_free)
        finally:
            self._loading = set()
        now = self._tick()
        added: list[HiTreeNode] = []
        for key, value in todo:
            child = node.children.get(key)
            if child is None:
                slots = self.host.alloc(1)
                if slots is None:
                    break
                child = HiTreeNode(key, None, node)
                child.host = slots[0]
                child.from_store = True
                self.host.slot_bytes_view(child.host).copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
                node.children[key] = child
                self._put.add(child.hash)
                added.append(child)
            child.last_access = now
            node = child
        self._record_stored(added, MEDIUM_CPU)

    def observe_compute(self, seconds: float, tokens: int) -> None:
        self.costs.observe_compute(seconds, tokens)

    def set_namespace(self, namespace: str) -> None:
        """After a weight update: read and write under the new weights' name (the tree is flushed
        with it; pages known stored under the old name are not known under the new one)."""
        if namespace != self.namespace:
            self.namespace = namespace
            self._put.clear()
            for rid in list(self._prefetches):
                self.cancel_prefetch(rid)

    def match_prefix(self, token_ids):
        self.poll_storage()
        return super().match_prefix(token_ids)

    def close(self):
        self.storage.close()
