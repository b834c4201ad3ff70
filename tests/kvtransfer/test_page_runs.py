from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.page_runs import page_runs, run_descriptors


def test_runs_break_where_either_side_breaks():
    s, d, n = page_runs([1, 2, 3, 7, 8, 9], [10, 11, 20, 21, 22, 40])
    assert list(zip(s, d, n)) == [(1, 10, 2), (3, 20, 1), (7, 21, 2), (9, 40, 1)]


def test_contiguous_pages_make_one_descriptor_per_buffer():
    src, dst, lengths = run_descriptors(range(5, 25), range(30, 50), [1000, 900000], [5000, 700000], 100)
    assert src == [1000 + 500, 900000 + 500]
    assert dst == [5000 + 3000, 700000 + 3000]
    assert lengths == [2000, 2000]


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError):
        page_runs([1, 2], [3])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), max_size=30, unique_by=(lambda t: t[0], lambda t: t[1])))
def test_descriptors_cover_exactly_the_page_pairs(pairs):
    page_bytes, bases_s, bases_d = 8, [0, 1000], [5000, 9000]
    src, dst, lengths = run_descriptors([p[0] for p in pairs], [p[1] for p in pairs], bases_s, bases_d, page_bytes)
    moved = {}
    for s, d, n in zip(src, dst, lengths):
        assert n > 0 and n % page_bytes == 0
        for off in range(0, n, page_bytes):
            moved[s + off] = d + off
    expected = {bs + ps * page_bytes: bd + pd * page_bytes for bs, bd in zip(bases_s, bases_d) for ps, pd in pairs}
    assert moved == expected
    assert len(src) <= 2 * len(pairs)
    assert np.all(np.asarray(lengths) > 0)


@pytest.mark.parametrize("src_heads,dst_heads,src_head,dst_head,num", [(2, 1, 1, 0, 1), (1, 2, 0, 1, 1), (4, 4, 0, 0, 4),
                                                                     (4, 2, 2, 0, 2), (3, 6, 0, 3, 3)])
def test_slice_descriptors_copy_exactly_the_head_slice(src_heads, dst_heads, src_head, dst_head, num):
    """Applied to two head-major byte pools [heads, pages, page_size, head_dim] of different page
    counts, the descriptors move exactly the slice, one descriptor per page run per head."""
    from pdserve.kvtransfer.page_runs import slice_descriptors

    src_pages_n, dst_pages_n, page_size, head_dim, item = 12, 10, 4, 3, 2
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, (2, src_heads, src_pages_n, page_size, head_dim * item), dtype=np.uint8)  # 2 buffers
    dst = np.zeros((2, dst_heads, dst_pages_n, page_size, head_dim * item), dtype=np.uint8)
    src_pages, dst_pages = [1, 2, 3, 7, 9], [4, 5, 8, 9, 2]
    sb, db = [0, src[0].nbytes], [0, dst[0].nbytes]
    head_page = page_size * head_dim * item
    s, d, n = slice_descriptors(src_pages, dst_pages, sb, db, head_page, src_pages_n * head_page,
                                dst_pages_n * head_page, src_head, dst_head, num)
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    for a, b, k in zip(s, d, n):
        flat_dst[b : b + k] = flat_src[a : a + k]
    want = np.zeros_like(dst)
    want[:, dst_head : dst_head + num][:, :, dst_pages] = src[:, src_head : src_head + num][:, :, src_pages]
    assert np.array_equal(dst, want)
    # 1-3 -> 4-5 breaks, so 4 runs: per buffer per head, never per token
    assert len(s) == 2 * num * 4
