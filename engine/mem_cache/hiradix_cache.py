"""Hierarchical prefix cache: the radix tree over two tiers, the KV pool (L1) and host memory (L2).

SGLang's HiRadixCache, on pdserve's page-edged radix tree. Each node is one page
and knows where its KV lives: ``page`` (its KV pool page, or None when evicted
from L1) and ``host`` (its host slot, or None when not backed up). A node exists
while it lives in at least one tier.

Rules (the invariants ``check_integrity`` proves):

- L1-resident nodes are closed upward: a node with a pool page has a parent
  with one (or the root). Eviction from L1 takes L1 leaves only, so a node's
  host-only descendants always hang below the L1 part of its path.
- Locks (a running request reading the path) are on L1 nodes only; the base
  class's ``_evictable`` counts unlocked L1 nodes, ``_num_nodes`` L1 nodes.
- Write policy (SGLang's ``--hicache-write-policy``): ``write_through`` backs a
  page up to host memory when the tree adopts it; ``write_through_selective``
  once it was hit twice (adopted, then matched again); ``write_back`` only when
  it is evicted from L1. An L1 eviction keeps a backed-up node as host-only and
  drops one that is not (with any host-only nodes below it).
- A full host tier evicts its least recently used host-only leaves; a backup
  that still finds no room is skipped (the page is then simply dropped later).
- ``match_prefix`` walks L1 then host-only nodes, and loads the host part back
  into the KV pool before returning (pool pages from free ones or by evicting
  unlocked L1 pages off the path), so the scheduler only ever sees L1 pages: the
  step that needs them runs after the copy. A load that finds no pool room
  returns the L1 part only. The load keeps the host copy (the node is then in
  both tiers, and a later L1 eviction costs no copy).

LoRA: a request under an adapter asks with its salted key (``radix_cache.cache_key``), so the
first page of its prefix, and with it the whole path, lives in that adapter's subtree in both
tiers: a page written back to host memory under one adapter is loaded again only for it, never for
another adapter or the base model. Each node knows its adapter (``lora_id``) for the store's keys.

KV events name the tier in vLLM's ``medium``: a page adopted or loaded back into
the pool is ``BlockStored`` "GPU", one evicted from it ``BlockRemoved`` "GPU"; a
host copy made is ``BlockStored`` "CPU", one dropped ``BlockRemoved`` "CPU". A
page in both tiers has had both stored events, so a router replaying them knows
each tier's pages (a flush that empties the tree is one ``AllBlocksCleared``).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from pdserve.engine.mem_cache.hicache_names import WRITE_POLICIES
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import RadixCache, TreeNode, key_lora_id

# hits before write_through_selective backs a page up (SGLang's write_through_threshold)
SELECTIVE_THRESHOLD = 2


@dataclass
class TierStats:
    """Counters of the tiers' traffic since start (monotonic, for /metrics)."""

    l1_hit_pages: int = 0  # matched pages already in the KV pool
    host_hit_pages: int = 0  # matched pages loaded back from host memory
    store_hit_pages: int = 0  # matched pages loaded from host memory where storage prefetched them
    host_write_pages: int = 0  # L1 -> L2 copies
    host_write_s: float = 0.0
    host_read_s: float = 0.0
    host_evicted_pages: int = 0  # host-only pages dropped for room


class HiTreeNode(TreeNode):
    __slots__ = ("host", "hits", "from_store", "lora_id")

    def __init__(self, key, page, parent):
        super().__init__(key, page, parent)
        # the adapter whose namespace the page is in (0: the base model's): named by the salt of
        # its path's first page, which a storage tier needs for the page's key
        self.lora_id = 0 if parent is None else parent.lora_id if parent.parent is not None else key_lora_id(key)
        self.host: int | None = None
        self.hits = 0
        self.from_store = False  # its host copy was fetched from the storage tier and not yet used


class HiRadixCache(RadixCache):
    def __init__(self, pool: PagePool, host: HostKVPool, write_policy: str = "write_through"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        super().__init__(pool)
        self.root = HiTreeNode((), 0, None)
        self.root.lock_ref = 1
        self.host = host
        self.write_policy = write_policy
        self.threshold = 1 if write_policy == "write_through" else SELECTIVE_THRESHOLD
        self.stats = TierStats()
        self._loading: set[int] = set()  # ids of host nodes being loaded: not host-evictable meanwhile

    # ----------------------------------------------------------------- lookup
    def match_prefix(self, token_ids):
        now = self._tick()
        node = cur = self.root  # node: the last L1 node; cur: the walk, through host-only nodes too
        pages: list[int] = []
        on_host: list[HiTreeNode] = []
        for key in self._keys(token_ids, len(token_ids) // self.page_size):
            cur = cur.children.get(key)
            if cur is None:
                break
            cur.last_access = now
            cur.hits += 1
            if cur.page is None:
                on_host.append(cur)
            else:
                pages.append(cur.page)
                node = cur
        self.stats.l1_hit_pages += len(pages)
        if self.write_policy == "write_through_selective":
            self._backup_hot(node)
        if on_host:
            node, loaded = self._load_back(node, on_host)
            pages.extend(loaded)
        return pages, node

    def _backup_hot(self, node: HiTreeNode) -> None:
        """Back up the matched L1 path's pages that reached the hit threshold."""
        hot = []
        while node is not self.root:
            if node.host is None and node.hits >= self.threshold:
                hot.append(node)
            node = node.parent
        self._backup(hot[::-1])

    def _load_back(self, node: HiTreeNode, on_host: list[HiTreeNode]) -> tuple[HiTreeNode, list[int]]:
        """Copy ``on_host`` (a chain below L1 node ``node``) into pool pages, as many as room allows."""
        self.lock(node)  # the matched L1 path must survive the evictions that make room
        self._loading = {id(n) for n in on_host}
        try:
            n = min(len(on_host), self.pool.num_free + self.evictable_pages)
            if n > self.pool.num_free:
                self.evict(n - self.pool.num_free)
            n = min(n, self.pool.num_free)
            chain = on_host[:n]
            pages = self.pool.alloc(n)
            t0 = time.perf_counter()
            self.host.read(self.pool, [c.host for c in chain], pages)
            self.stats.host_read_s += time.perf_counter() - t0
        finally:
            self._loading = set()
            self.unlock(node)
        for c, p in zip(chain, pages):
            c.page = p
            if c.from_store:
                self.stats.store_hit_pages += 1
                c.from_store = False
            else:
                self.stats.host_hit_pages += 1
        self._num_nodes += n
        self._evictable += n
        self._record_stored(chain)
        return (chain[-1] if chain else node), pages

    # -------------------------------------------------------------- insertion
    def insert(self, token_ids, pages, num_cache_pages):
        node, stored = self._insert_pages(token_ids, pages, num_cache_pages)
        self._record_stored(stored)
        if self.write_policy != "write_back":
            self._backup([n for n in stored if n.host is None and n.hits >= self.threshold])
        return node

    def _give_page(self, parent, key, page, child):
        if child is None:
            child = HiTreeNode(key, page, parent)
            parent.children[key] = child
        else:  # host-only: this request computed it again, its page becomes the L1 copy
            child.page = page
        child.hits += 1
        return child

    def _backup(self, nodes: list[HiTreeNode]) -> None:
        """Copy the L1 pages of ``nodes`` into host slots (making room by host eviction); those
        that find no slot stay unbacked."""
        if not nodes:
            return
        short = len(nodes) - self.host.num_free
        if short > 0:
            self._evict_host(short)
        nodes = nodes[: self.host.num_free]
        slots = self.host.alloc(len(nodes))
        t0 = time.perf_counter()
        self.host.write(self.pool, [n.page for n in nodes], slots)
        self.stats.host_write_s += time.perf_counter() - t0
        self.stats.host_write_pages += len(nodes)
        for n, s in zip(nodes, slots):
            n.host = s
        self._record_stored(nodes, MEDIUM_CPU)

    # --------------------------------------------------------------- eviction
    def _l1_leaves(self) -> list[HiTreeNode]:
        """Unlocked L1 nodes with no L1 child."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.page is None:
                continue
            l1_children = [c for c in n.children.values() if c.page is not None]
            if l1_children:
                stack.extend(l1_children)
            elif n.lock_ref == 0:
                out.append(n)
        return out

    def _evict(self, num_pages: int) -> list[int]:
        """Evict up to ``num_pages`` unlocked L1 leaves, LRU first, to host or away; returns their hashes."""
        heap = self._l1_leaves()
        heapq.heapify(heap)
        victims: list[HiTreeNode] = []
        freed: list[int] = []
        while heap and len(victims) < num_pages:
            n = heapq.heappop(heap)
            victims.append(n)
            freed.append(n.page)
            n.page = None  # out of L1 now, so that the parent's leaf test sees it gone
            parent = n.parent
            if (parent is not self.root and parent.lock_ref == 0
                    and all(c.page is None for c in parent.children.values())):
                heapq.heappush(heap, parent)
        if self.write_policy == "write_back":
            unbacked = [(n, p) for n, p in zip(victims, freed) if n.host is None]
            for n, p in unbacked:
                n.page = p
            self._backup([n for n, _ in unbacked])
            for n, _ in unbacked:
                n.page = None
        for n in victims:
            if n.host is None:
                self._drop_subtree(n)
        self._num_nodes -= len(victims)
        self._evictable -= len(victims)
        self.pool.free(freed)
        return [n.hash for n in victims]

    def _drop_subtree(self, n: HiTreeNode) -> None:
        """Remove ``n`` (out of L1, not backed up) and the host-only nodes below it."""
        del n.parent.children[n.key]
        stack = list(n.children.values())
        gone = []
        while stack:
            c = stack.pop()
            stack.extend(c.children.values())
            self.host.free([c.host])
            gone.append(c.hash)
            self.stats.host_evicted_pages += 1
        self._record_removed(gone, MEDIUM_CPU)

    def _evict_host(self, num_slots: int) -> int:
        """Drop up to ``num_slots`` host-only leaves, LRU first; returns how many."""
        heap, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.page is None and not n.children and id(n) not in self._loading:
                heap.append(n)
        heapq.heapify(heap)
        gone: list[int] = []
        while heap and len(gone) < num_slots:
            n = heapq.heappop(heap)
            parent = n.parent
            del parent.children[n.key]
            self.host.free([n.host])
            gone.append(n.hash)
            if (parent is not self.root and parent.page is None and not parent.children
                    and id(parent) not in self._loading):
                heapq.heappush(heap, parent)
        self.stats.host_evicted_pages += len(gone)
        self._record_removed(gone, MEDIUM_CPU)
        return len(gone)

    def flush(self):
        mark = len(self.events)
        removed = self._evict(self.evictable_pages)
        self._evict_host(self.host.num_used)
        if self.record_events and not self.root.children:
            # both tiers are empty: one clear says it; the store's pages (written by a write-back
            # flush) stay, since the store is not this rank's to clear
            kept = [e for e in self.events[mark:] if getattr(e, "medium", None) == MEDIUM_STORAGE]
            del self.events[mark:]
            self.events.extend(kept)
            self.events.append(AllBlocksCleared())
        else:
            self._record_removed(removed)
        return len(removed)

    # ------------------------------------------------------------------ state
    @property
    def num_host_pages(self) -> int:
        """Slots of the host tier in use (host-only nodes and L1 nodes backed up)."""
        return self.host.num_used

    def check_integrity(self):
        l1 = evictable = 0
        pages: set[int] = set()
        slots: set[int] = set()
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            # one page; an adapter's first page leads with its salt (``RadixCache._keys``)
            salted = n.parent is self.root and len(n.key) == self.page_size + 1 and n.lora_id > 0
            if len(n.key) != self.page_size and not salted:
                raise AssertionError("radix edge is not one page")
            if n.lora_id != (n.parent.lora_id if n.parent is not self.root else key_lora_id(n.key)):
                raise AssertionError("radix node's adapter differs from its path's")
            if n.page is None and n.host is None:
                raise AssertionError("radix node lives in no tier")
            if n.page is not None:
                if n.parent is not self.root and n.parent.page is None:
                    raise AssertionError("L1 node below a node out of L1")
                if n.page in pages or n.page == 0:
                    raise AssertionError(f"radix page {n.page} held twice or is the scratch page")
                pages.add(n.page)
                l1 += 1
                evictable += n.lock_ref == 0
            elif n.lock_ref:
                raise AssertionError("a locked node is out of L1")
            if n.host is not None:
                if n.host in slots:
                    raise AssertionError(f"host slot {n.host} held twice")
                slots.add(n.host)
            if n.lock_ref < 0 or any(c.lock_ref > n.lock_ref for c in n.children.values()):
                raise AssertionError("child locked more than its parent")
            stack.extend(n.children.values())
        if l1 != self._num_nodes or evictable != self._evictable:
            raise AssertionError(
                f"radix counters: L1 nodes {self._num_nodes} vs {l1}, evictable {self._evictable} vs {evictable}"
            )
        if not pages <= self.pool.used_pages():
            raise AssertionError("radix holds pages the pool thinks are free")
        self.host.check_integrity()
        if slots != self.host.used_slots():
            raise AssertionError(f"host slots in use {self.host.num_used} but the tree holds {len(slots)}")
