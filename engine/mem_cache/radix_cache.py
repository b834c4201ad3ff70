"""Prefix cache over page-aligned token blocks.

A finished (or retracted) request hands its full pages of KV to the cache; a
later request whose prompt starts with the same tokens reuses those pages
instead of recomputing them. The tree is a trie whose edges are whole pages
(``page_size`` tokens): matching and inserting never split a page, because a
page can only be shared when every token in it agrees.

Pages held by the cache are "used" in the PagePool. A node is *locked* while a
running request reads its page (``lock_ref`` counts the requests whose path
goes through it); only unlocked leaves are evicted, least recently used first.

``NoPrefixCache`` has the same interface and caches nothing; it is what
``disable_radix_cache`` selects.

Events: after ``enable_events()``, the cache records what it stores, evicts and
flushes as KV events (``kv_events``: one ``BlockStored`` per insert with new
pages, one ``BlockRemoved`` per eviction, ``AllBlocksCleared`` when a flush
empties it; ``medium`` "GPU", the pool's tier) in ``events``, which the
scheduler process drains and publishes.
Each node keeps its block's chained hash, so a subscriber replaying the events
rebuilds exactly this tree.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import Sequence

from pdserve.engine.mem_cache.kv_events import (
    ADAPTER_SALT_BASE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_hash,
)
from pdserve.engine.mem_cache.page_pool import PagePool



class AdapterTokens(list):
    """Token ids computed under a LoRA adapter: ``lora_id`` (> 0) salts the key of the first page,
    so a prefix computed under one adapter (or none) never matches under another, and its chained
    block hashes differ too. What a cache is asked with for a request that has an adapter."""

    def __init__(self, tokens, lora_id: int):
        super().__init__(tokens)
        self.lora_id = lora_id


def cache_key(token_ids: list[int], lora_id: int) -> list[int]:
    """``token_ids`` as the prefix cache keys them under adapter ``lora_id`` (0: the base model)."""
    return AdapterTokens(token_ids, lora_id) if lora_id else token_ids


def key_lora_id(key: tuple[int, ...]) -> int:
    """The adapter whose salt leads a page's ``key`` (the first page of an adapter's prefix:
    ``ADAPTER_SALT_BASE - lora_id``, above every token id since ``lora_id`` < 2**31); 0 for none."""
    return ADAPTER_SALT_BASE - key[0] if key and key[0] > ADAPTER_SALT_BASE // 2 else 0


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.record_events = False
        self.events: list[KVEvent] = []

    def enable_events(self) -> None:
        """Record KV events from now on (a server that publishes them calls this before serving)."""
        self.record_events = True

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last drain, oldest first."""
        out, self.events = self.events, []
        return out

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], object]:
        """Longest cached page-aligned prefix of ``token_ids``: its pages and the last node.

        The node is passed to ``lock``/``unlock``; the pages stay valid only while it is locked.
        """

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protect the path from the root to ``node`` from eviction (one per request)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undo one ``lock``."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: list[int], num_cache_pages: int) -> object:
        """Take a request's KV: ``token_ids`` are the tokens whose KV is in ``pages``.

        ``pages[:num_cache_pages]`` came from ``match_prefix`` (already the cache's). Full
        pages not yet cached are adopted; duplicates and the partial last page are freed.
        Returns the node of the longest inserted prefix (unlocked).
        """

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages, least recently used first; return how many."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages held by the cache and not locked: they can be freed on demand."""

    @abstractmethod
    def held_pages(self) -> set[int]:
        """Every page the cache owns (locked or not)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the cache's own bookkeeping is inconsistent."""

    def flush(self) -> int:
        """Drop every unlocked page; return how many pages were freed."""
        return self.evict(self.evictable_pages)

    # a cache with a storage tier (mem_cache/store_cache.py) fetches a queued request's pages
    # while it waits; the scheduler admits it once the prefetch policy says so
    def start_prefetch(self, rid: str, token_ids: Sequence[int]) -> None:
        """A request was queued: start fetching the pages of ``token_ids`` it may reuse."""

    def prefetch_ready(self, rid: str) -> bool:
        """Whether the request's prefetch lets it be admitted now."""
        return True

    def wait_for_prefetch(self, rid: str, timeout: float) -> bool:
        """Block until a storage fetch lands or ``timeout`` s pass, if the request's prefetch is still
        running (the scheduler's idle wait for its queue head); False at once when it is not."""
        return False

    def cancel_prefetch(self, rid: str) -> None:
        """The request ended: drop its prefetch."""

    def observe_compute(self, seconds: float, tokens: int) -> None:
        """A prefill step computed ``tokens`` tokens in ``seconds`` (what a fetch is weighed against)."""

    def name_adapter(self, lora_id: int, path: str) -> None:
        """LoRA adapter ``lora_id`` is served from ``path`` (at start, and at each run-time load): a
        storage tier keys its pages under the adapter's namespace (``storage_key``)."""

    def close(self) -> None:
        """Stop background work (a storage tier's thread)."""


class NoPrefixCache(PrefixCache):
    def match_prefix(self, token_ids):
        return [], None

    def lock(self, node):
        pass

    def unlock(self, node):
        pass

    def insert(self, token_ids, pages, num_cache_pages):
        assert num_cache_pages == 0
        self.pool.free(pages)
        return None

    def evict(self, num_pages):
        return 0

    @property
    def evictable_pages(self):
        return 0

    def held_pages(self):
        return set()

    def check_integrity(self):
        pass


class TreeNode:
    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access", "hash")

    def __init__(self, key: tuple[int, ...], page: int, parent: "TreeNode | None"):
        self.key = key
        self.page = page
        self.parent = parent
        # chained block hash, what KV events name this block by (None for the root)
        self.hash = None if parent is None else block_hash(parent.hash, key)
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class RadixCache(PrefixCache):
    def __init__(self, pool: PagePool):
        super().__init__(pool)
        self.root = TreeNode((), 0, None)
        self.root.lock_ref = 1  # the root holds no page and is never evicted
        self._clock = 0
        self._num_nodes = 0  # nodes holding a page (all but the root)
        self._evictable = 0

    # ----------------------------------------------------------------- lookup
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _keys(self, token_ids: Sequence[int], num_pages: int):
        """Each page's key: its tokens; under an adapter (``AdapterTokens``) the first page's key
        leads with ``2**32 - lora_id``, which no token id is (the block hash packs uint32s)."""
        ps = self.page_size
        lora_id = getattr(token_ids, "lora_id", 0)
        for i in range(num_pages):
            key = tuple(token_ids[i * ps : (i + 1) * ps])
            yield (ADAPTER_SALT_BASE - lora_id,) + key if lora_id and i == 0 else key

    def match_prefix(self, token_ids):
        now = self._tick()
        node = self.root
        pages: list[int] = []
        for key in self._keys(token_ids, len(token_ids) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            pages.append(child.page)
            node = child
        return pages, node

    # ---------------------------------------------------------------- locking
    def lock(self, node):
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= 1
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node):
        while node is not None:
            if node.lock_ref <= 0:
                raise AssertionError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += 1
            node = node.parent

    # -------------------------------------------------------------- insertion
    def insert(self, token_ids, pages, num_cache_pages):
        node, stored = self._insert_pages(token_ids, pages, num_cache_pages)
        self._record_stored(stored)
        return node

    def _insert_pages(self, token_ids, pages, num_cache_pages) -> tuple[TreeNode, list[TreeNode]]:
        """Put the request's full pages into the tree (pages it computed again while the tree had
        them are freed). Returns the last node and the nodes that gained a pool page: a chain,
        since once one gains a page so do its descendants here."""
        now = self._tick()
        num_full = min(len(token_ids) // self.page_size, len(pages))
        node = self.root
        to_free: list[int] = []
        stored: list[TreeNode] = []
        for i, key in enumerate(self._keys(token_ids, num_full)):
            child = node.children.get(key)
            if child is None or child.page is None:
                if i < num_cache_pages:
                    raise AssertionError("a locked cache page vanished from the tree")
                child = self._give_page(node, key, pages[i], child)
                stored.append(child)
                self._num_nodes += 1
                self._evictable += 1
            elif i >= num_cache_pages:
                # computed again by this request while the cache already had it
                if child.page != pages[i]:
                    to_free.append(pages[i])
            elif child.page != pages[i]:
                raise AssertionError("request's cached page differs from the tree's")
            child.last_access = now
            node = child
        to_free.extend(pages[max(num_full, num_cache_pages) :])
        self.pool.free(to_free)
        return node, stored

    def _give_page(self, parent: TreeNode, key, page: int, child: TreeNode | None) -> TreeNode:
        """The node of ``key`` under ``parent``, now holding pool page ``page``: a new node here
        (``child`` is None); a tiered tree may give the page to its page-less ``child``."""
        child = TreeNode(key, page, parent)
        parent.children[key] = child
        return child

    def _record_stored(self, stored: list[TreeNode], medium: str = MEDIUM_GPU) -> None:
        """``stored`` (root side first) now live in tier ``medium``: one ``BlockStored`` per run of
        nodes each the child of the one before, since an event's blocks are one chain."""
        if not stored or not self.record_events:
            return
        start = 0
        for i in range(1, len(stored) + 1):
            if i < len(stored) and stored[i].parent is stored[i - 1]:
                continue
            run = stored[start:i]
            self.events.append(BlockStored(
                block_hashes=[n.hash for n in run],
                parent_block_hash=run[0].parent.hash,
                token_ids=[t for n in run for t in n.key[-self.page_size:]],  # without an adapter's salt
                block_size=self.page_size,
                lora_id=self._lora_id(run[0]),
                medium=medium,
            ))
            start = i

    def _lora_id(self, node: TreeNode) -> int | None:
        """The adapter whose namespace ``node`` is in (its first page's salt), None for the base's."""
        while node.parent is not None and node.parent is not self.root:
            node = node.parent
        return ADAPTER_SALT_BASE - node.key[0] if len(node.key) > self.page_size else None

    def _record_removed(self, hashes: list[int], medium: str = MEDIUM_GPU) -> None:
        if hashes and self.record_events:
            self.events.append(BlockRemoved(block_hashes=hashes, medium=medium))

    # --------------------------------------------------------------- eviction
    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    def evict(self, num_pages):
        removed = self._evict(num_pages)
        self._record_removed(removed)
        return len(removed)

    def flush(self):
        removed = self._evict(self.evictable_pages)
        if self.record_events and self._num_nodes == 0:
            self.events.append(AllBlocksCleared())
        else:  # locked pages stayed (a flush while busy): only some went
            self._record_removed(removed)
        return len(removed)

    def _evict(self, num_pages: int) -> list[int]:
        """Evict up to ``num_pages`` unlocked leaves, LRU first; returns their block hashes."""
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        removed: list[int] = []
        while heap and len(freed) < num_pages:
            n = heapq.heappop(heap)
            parent = n.parent
            del parent.children[n.key]
            freed.append(n.page)
            removed.append(n.hash)
            self._num_nodes -= 1
            self._evictable -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        self.pool.free(freed)
        return removed

    @property
    def evictable_pages(self):
        return self._evictable

    @property
    def num_pages(self) -> int:
        return self._num_nodes

    def held_pages(self):
        """The KV pool pages the tree holds (a node whose KV lives in a lower tier only, as
        ``HiRadixCache``'s host-only nodes, holds none)."""
        out, stack = set(), list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.page is not None:
                out.add(n.page)
            stack.extend(n.children.values())
        return out

    def check_integrity(self):
        count = evictable = 0
        seen: set[int] = set()
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            count += 1
            if n.page in seen or n.page == 0:
                raise AssertionError(f"radix page {n.page} held twice or is the scratch page")
            seen.add(n.page)
            # one page; an adapter's first page leads with its salt (``_keys``)
            salted = n.parent is self.root and len(n.key) == self.page_size + 1 and key_lora_id(n.key) > 0
            if len(n.key) != self.page_size and not salted:
                raise AssertionError("radix edge is not one page")
            if n.lock_ref < 0 or any(c.lock_ref > n.lock_ref for c in n.children.values()):
                raise AssertionError("child locked more than its parent")
            evictable += n.lock_ref == 0
            stack.extend(n.children.values())
        if count != self._num_nodes or evictable != self._evictable:
            raise AssertionError(
                f"radix counters: nodes {self._num_nodes} vs {count}, evictable {self._evictable} vs {evictable}"
            )
        if not seen <= self.pool.used_pages():
            raise AssertionError("radix holds pages the pool thinks are free")


def make_prefix_cache(pool: PagePool, disable: bool) -> PrefixCache:
    return NoPrefixCache(pool) if disable else RadixCache(pool)
