"""An approximate radix tree of the prompts sent to each worker (cache-aware routing).

"Approximate" because it records what the router sent, not what the worker's
own radix cache still holds. One tree is shared by all workers ("tenants");
each node records which tenants have sent a prompt through it and when (a
logical clock, so tests are deterministic). Each tenant's share is bounded by
``max_size`` characters: past it, that tenant's least recently used leaves are
evicted, down to ``evict_to`` of the bound so eviction is amortised.
"""

from __future__ import annotations

import heapq


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix, by binary search on slices (C compares, not a Python loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("text", "children", "parent", "tenants")

    def __init__(self, text: str, parent: "_Node | None"):
        self.text = text
        self.children: dict[str, _Node] = {}  # first character -> child
        self.parent = parent
        self.tenants: dict[str, int] = {}  # tenant -> last access (logical clock)


class PrefixTree:
    def __init__(self, max_size: int, evict_to: float = 0.8):
        self.max_size = max_size
        self.evict_to = evict_to
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}  # tenant -> characters it owns in the tree
        self._clock = 0

    def insert(self, text: str, tenant: str) -> None:
        self._clock += 1
        now = self._clock
        node = self.root
        node.tenants[tenant] = now
        pos = 0
        added = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                leaf.tenants[tenant] = now
                node.children[text[pos]] = leaf
                added += len(leaf.text)
                break
            edge = child.text
            if text.startswith(edge, pos):
                matched = len(edge)
            else:
                matched = common_prefix_len(edge, text[pos:pos + len(edge)])
                child = self._split(child, matched)
            if tenant not in child.tenants:
                added += len(child.text)
            child.tenants[tenant] = now
            node = child
            pos += matched
        if added:
            size = self.sizes.get(tenant, 0) + added
            self.sizes[tenant] = size
            if size > self.max_size:
                self.evict(tenant, int(self.max_size * self.evict_to))

    def match(self, text: str, allowed: set[str] | frozenset[str]) -> tuple[int, str | None]:
        """Longest prefix of ``text`` sent to one of ``allowed``: (matched characters, that tenant).

        Tenants of a child are a subset of its parent's, so the walk stops at
        the first node none of ``allowed`` has visited. Among tenants at the
        deepest node, the most recently used wins.
        """
        node = self.root
        pos = 0
        best_len, best_node = 0, None
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None or not any(t in allowed for t in child.tenants):
                break
            edge = child.text
            matched = len(edge) if text.startswith(edge, pos) else common_prefix_len(edge, text[pos:pos + len(edge)])
            pos += matched
            best_len, best_node = pos, child
            if matched < len(edge):
                break
            node = child
        if best_node is None:
            return 0, None
        tenant = max((t for t in best_node.tenants if t in allowed), key=best_node.tenants.__getitem__)
        return best_len, tenant

    def evict(self, tenant: str, target: int) -> None:
        """Drop ``tenant``'s least recently used leaves until it owns at most ``target`` characters."""
        heap = [(n.tenants[tenant], id(n), n) for n in self._nodes()
                if n is not self.root and self._is_leaf_of(n, tenant)]
        heapq.heapify(heap)
        size = self.sizes.get(tenant, 0)
        while size > target and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            size -= len(node.text)
            parent = node.parent
            if not node.tenants:
                del parent.children[node.text[0]]
            if parent is not self.root and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        self.sizes[tenant] = size

    def remove_tenant(self, tenant: str) -> None:
        self.evict(tenant, 0)
        self.root.tenants.pop(tenant, None)
        self.sizes.pop(tenant, None)

    def check_integrity(self) -> None:
        """Sizes equal the characters each tenant owns; every child's tenants are in its parent's."""
        owned: dict[str, int] = {}
        for node in self._nodes():
            if node is self.root:
                continue
            assert node.text and node.parent.children[node.text[0]] is node
            assert node.tenants, "a node nobody owns must have been removed"
            for t in node.tenants:
                assert t in node.parent.tenants, f"{t} at a child but not its parent"
                owned[t] = owned.get(t, 0) + len(node.text)
        for t, size in self.sizes.items():
            assert owned.get(t, 0) == size, (t, owned.get(t, 0), size)

    # internals -----------------------------------------------------------
    def _split(self, child: _Node, at: int) -> _Node:
        """Split ``child``'s edge after ``at`` characters; returns the new upper node."""
        upper = _Node(child.text[:at], child.parent)
        upper.tenants = dict(child.tenants)
        child.parent.children[upper.text[0]] = upper
        child.text = child.text[at:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def _is_leaf_of(self, node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
