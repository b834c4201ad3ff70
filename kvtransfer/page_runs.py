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
    page_size: int,
    src_token_bytes: int,
    dst_token_bytes: int,
    src_offset: int,
    dst_offset: int,
    nbytes: int,
) -> tuple[list[int], list[int], list[int]]:
    """A head slice of each page run: one descriptor per token per run per buffer.

    With the token-major page ``[page_size, kv_heads, head_dim]`` a run of heads is ``nbytes``
    at ``src_offset`` inside each token's ``src_token_bytes`` (and at ``dst_offset`` of
    ``dst_token_bytes`` on the other side). When the slice is every head of both sides the
    pages are contiguous and the runs coalesce as in ``run_descriptors``.
    """
    if nbytes == src_token_bytes == dst_token_bytes:
        return run_descriptors(src_pages, dst_pages, src_bases, dst_bases, page_size * nbytes)
    if len(src_bases) != len(dst_bases):
        raise ValueError(f"{len(src_bases)} local buffers but {len(dst_bases)} remote buffers")
    s0, d0, n = page_runs(src_pages, dst_pages)
    # token slots of every run, [tokens]: a run of n pages is n * page_size consecutive token slots
    run_of = np.repeat(np.arange(n.size), n * page_size)
    within = np.arange(run_of.size) - np.repeat(np.cumsum(n * page_size) - n * page_size, n * page_size)
    src_tok = s0[run_of] * page_size + within
    dst_tok = d0[run_of] * page_size + within
    sb = np.asarray(src_bases, dtype=np.int64)[:, None]  # [buffers, 1]
    db = np.asarray(dst_bases, dtype=np.int64)[:, None]
    src = (sb + src_tok[None, :] * src_token_bytes + src_offset).ravel()  # [buffers * tokens]
    dst = (db + dst_tok[None, :] * dst_token_bytes + dst_offset).ravel()
    return src.tolist(), dst.tolist(), [nbytes] * src.size


def split_by_layer(
    src: Sequence[int], dst: Sequence[int], lengths: Sequence[int], num_layers: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """``run_descriptors``/``slice_descriptors`` output cut into each layer's (src, dst, lengths).

    Their descriptors are buffer-major over all layers' K then V buffers (``2 * num_layers``
    blocks of one size), so layer ``l`` is block ``l`` (its K) and block ``num_layers + l`` (its V).
    """
    if len(src) % (2 * num_layers):
        raise ValueError(f"{len(src)} descriptors do not split over {2 * num_layers} K/V buffers")
    per = len(src) // (2 * num_layers)
    out = []
    for layer in range(num_layers):
        k, v = slice(layer * per, (layer + 1) * per), slice((num_layers + layer) * per, (num_layers + layer + 1) * per)
        out.append((list(src[k]) + list(src[v]), list(dst[k]) + list(dst[v]), list(lengths[k]) + list(lengths[v])))
    return out
