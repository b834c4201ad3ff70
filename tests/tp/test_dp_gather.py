"""DP attention's row exchange around a dense layer, in four real processes joined by gloo: two
attention groups of two ranks. ``dp_gather`` returns every group's rows in group order whatever
the counts (one group empty, both, uneven), each rank sending only its share of its group's rows
(the rows padded to the largest count, split over the group's ranks), never the whole group's;
``dp_scatter`` hands each group its own rows of the world's summed partial products.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdserve.entrypoints.cluster import free_port

pytestmark = pytest.mark.timeout(300)

GROUPS, ATTN = 2, 2
HIDDEN = 3
COUNTS = [[5, 2], [0, 3], [1, 0], [4, 4], [0, 0]]


def rows_of(group: int, n: int) -> torch.Tensor:
    return torch.arange(n * HIDDEN, dtype=torch.float32).view(n, HIDDEN) + 1000 * (group + 1)


def _rank(world_rank: int, addr: str, out) -> None:
    import torch.distributed as dist

    from pdserve.engine.model_executor import dp_attention as dpa
    from pdserve.engine.model_executor.parallel import close_tp, init_dp_attention

    torch.set_num_threads(1)
    group, attn_rank = divmod(world_rank, ATTN)
    try:
        init_dp_attention(group, GROUPS, addr, 60.0, torch.device("cpu"), attn_rank=attn_rank, attn_size=ATTN)
        sent = []
        gather = dist.all_gather

        def counting(parts, tensor, *a, **kw):
            sent.append(tensor.shape[0])
            return gather(parts, tensor, *a, **kw)

        dist.all_gather = counting
        results = []
        for counts in COUNTS:
            rows = dpa.dp_gather(rows_of(group, counts[group]), counts)
            mine = dpa.dp_scatter(rows * (world_rank + 1), counts)  # the world's sum: rows x (1+2+3+4)
            results.append((rows.tolist(), mine.tolist()))
        out.put((world_rank, results, sent))
        close_tp()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((world_rank, f"{type(e).__name__}: {e}", None))
        raise


def test_groups_of_two_each_rank_sends_its_share():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, addr, out), daemon=True) for r in range(GROUPS * ATTN)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (results, sent)) for r, results, sent in (out.get(timeout=240) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    world = sum(range(1, GROUPS * ATTN + 1))
    for r in range(GROUPS * ATTN):
        results, sent = got[r]
        assert isinstance(results, list), results
        group = r // ATTN
        for counts, (rows, mine) in zip(COUNTS, results):
            want = torch.cat([rows_of(g, counts[g]) for g in range(GROUPS)])
            assert rows == want.tolist(), (r, counts)
            assert mine == (rows_of(group, counts[group]) * world).tolist(), (r, counts)
        # one all-gather per exchange with rows (none when every group is empty), of half the rows
        assert sent == [-(-max(c) // ATTN) for c in COUNTS if max(c)], r
