"""The approximate prefix tree: matches, splits, per-tenant eviction, integrity."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.kv.prefix_tree import PrefixTree, common_prefix_len


@given(st.text("ab", max_size=40), st.text("ab", max_size=40))
def test_common_prefix_len(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(a, b) == n


def test_match_returns_longest_prefix_and_its_tenant():
    t = PrefixTree(10_000)
    t.insert("hello world", "A")
    t.insert("hello there", "B")
    assert t.match("hello world!", {"A", "B"}) == (11, "A")
    assert t.match("hello thermos", {"A", "B"}) == (10, "B")
    assert t.match("help", {"A", "B"})[0] == 3
    assert t.match("hello world", {"B"}) == (6, "B")  # only B's path counts
    assert t.match("zzz", {"A", "B"}) == (0, None)
    t.check_integrity()
    assert t.sizes == {"A": 11, "B": 11}


def test_eviction_drops_least_recently_used_first():
    t = PrefixTree(max_size=30, evict_to=1.0)
    t.insert("aaaaaaaaaa", "A")  # 10 chars, oldest
    t.insert("bbbbbbbbbb", "A")
    t.insert("cccccccccc", "A")
    t.insert("aaaaaaaaaa", "A")  # touch: "b..." is now the oldest
    t.insert("dddddddddd", "A")  # 40 > 30: evict the oldest leaf
    assert t.sizes["A"] == 30
    assert t.match("bbbbbbbbbb", {"A"}) == (0, None)
    assert t.match("aaaaaaaaaa", {"A"}) == (10, "A")
    t.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("abc", min_size=1, max_size=12), st.sampled_from("XYZ")),
                max_size=40))
def test_random_inserts_keep_integrity_and_bounds(ops):
    t = PrefixTree(max_size=25)
    sent: dict[str, list[str]] = {}
    for text, tenant in ops:
        t.insert(text, tenant)
        sent.setdefault(tenant, []).append(text)
        t.check_integrity()
        assert all(size <= 25 for size in t.sizes.values())
    # the most recent prompt of each tenant is never evicted by its own insertion when it fits
    for tenant, texts in sent.items():
        last = texts[-1]
        if len(last) <= 20:
            assert t.match(last, {tenant})[0] == len(last)
