"""Turning (source page, destination page) pairs into as few write descriptors as possible."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of pages contiguous on both sides: (src start, dst start, length), each ``[num_runs]`` int64."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    # a run breaks wherever either side does not step by exactly one page
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return src[starts], dst[starts], ends - starts


def run_descriptors(
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    page_bytes: int,
) -> tuple[list[int], list[int], list[int]]:
    """One (src addr, dst addr, length) per run per buffer (all layers' K then V).

    ``src_bases[i]``/``dst_bases[i]`` are buffer i's page-0 addresses on each side;
    both sides have the same ``page_bytes`` (checked at registration).
    """
    if len(src_bases) != len(dst_bases):
        raise ValueError(f"{len(src_bases)} local buffers but {len(dst_bases)} remote buffers")
    s0, d0, n = page_runs(src_pages, dst_pages)
    sb = np.asarray(src_bases, dtype=np.int64)[:, None]  # [buffers, 1]
    db = np.asarray(dst_bases, dtype=np.int64)[:, None]
    src = (sb + s0[None, :] * page_bytes).ravel()  # [buffers * runs]
    dst = (db + d0[None, :] * page_bytes).ravel()
    lengths = np.broadcast_to(n[None, :] * page_bytes, (len(src_bases), n.size)).ravel()
    return src.tolist(), dst.tolist(), lengths.tolist()


def slice_descriptors(
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    head_page_bytes: int,
    src_plane_bytes: int,
    dst_plane_bytes: int,
    src_head: int,
    dst_head: int,
    num_heads: int,
) -> tuple[list[int], list[int], list[int]]:
    """A head slice of each page run: one descriptor per run per head per buffer.

    The pools are head-major (``[heads, pages, page_size, head_dim]`` per buffer): head ``h``
    of a buffer is a plane of pages at ``base + h * plane_bytes``, in which a page run is
    contiguous. So each head of the slice is a buffer of its own for ``run_descriptors``:
    heads ``[src_head, src_head + num_heads)`` of the source planes go to heads
    ``[dst_head, dst_head + num_heads)`` of the destination's. The output stays buffer-major
    (each buffer's heads, then the next buffer's), which ``split_by_layer`` relies on.
    """
    heads = np.arange(num_heads, dtype=np.int64)
    src = (np.asarray(src_bases, dtype=np.int64)[:, None] + (src_head + heads)[None, :] * src_plane_bytes).ravel()
    dst = (np.asarray(dst_bases, dtype=np.int64)[:, None] + (dst_head + heads)[None, :] * dst_plane_bytes).ravel()
    return run_descriptors(src_pages, dst_pages, src.tolist(), dst.tolist(), head_page_bytes)


def split_by_layer(
    src: Sequence[int], dst: Sequence[int], lengths: Sequence[int], num_layers: int, kinds: int = 2
) -> list[tuple[list[int], list[int], list[int]]]:
    """``run_descriptors``/``slice_descriptors`` output cut into each layer's (src, dst, lengths).

    Their descriptors are buffer-major over all layers' K buffers, then (``kinds`` 2: an MHA pool)
    all layers' V buffers: ``kinds * num_layers`` blocks of one size (every buffer has the same runs
    and heads), so layer ``l`` is block ``l`` (its K) and block ``num_layers + l`` (its V). A latent
    pool has K buffers only (``kinds`` 1: one block per layer).
    """
    if len(src) % (kinds * num_layers):
        raise ValueError(f"{len(src)} descriptors do not split over {kinds * num_layers} K/V buffers")
    per = len(src) // (kinds * num_layers)
    out = []
    for layer in range(num_layers):
        blocks = [slice((b * num_layers + layer) * per, (b * num_layers + layer + 1) * per) for b in range(kinds)]
        out.append(tuple([x for b in blocks for x in seq[b]] for seq in (src, dst, lengths)))
    return out
