"""The router's admission queue orders waiting requests by priority, then arrival (pure logic on
one event loop: no sockets). Each scenario holds every slot, queues requests, then frees slots
one at a time and records the order in which the waiters got theirs."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.admission import Admission
from pdserve.router.errors import RouterError
from pdserve.router.request_priority import PRIORITY_HEADER, request_priority


async def _queue(adm: Admission, priorities: list[int]) -> tuple[list[asyncio.Task], list[int]]:
    order: list[int] = []

    async def waiter(i: int, p: int):
        await adm.acquire(p)
        order.append(i)

    tasks = []
    for i, p in enumerate(priorities):
        tasks.append(asyncio.ensure_future(waiter(i, p)))
        while adm.queued < i + 1:  # queued in this exact arrival order
            await asyncio.sleep(0)
    return tasks, order


async def _drain(adm: Admission, tasks: list[asyncio.Task]) -> None:
    for _ in tasks:
        adm.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)


async def test_higher_priority_goes_first_then_arrival_order():
    adm = Admission(1, 10, 60.0)
    await adm.acquire()
    tasks, order = await _queue(adm, [0, 0, 5, 1, 5])
    assert adm.queued_by_priority() == {0: 2, 5: 2, 1: 1}
    await _drain(adm, tasks)
    assert order == [2, 4, 3, 0, 1]
    assert adm.queued == 0 and adm.active == 1


async def test_low_values_first_reverses_the_order():
    adm = Admission(1, 10, 60.0, low_priority_values_first=True)
    await adm.acquire()
    tasks, order = await _queue(adm, [3, -1, 3, 0])
    await _drain(adm, tasks)
    assert order == [1, 3, 0, 2]


async def test_without_priorities_the_queue_is_fifo():
    adm = Admission(1, 10, 60.0)
    await adm.acquire()
    tasks, order = await _queue(adm, [0] * 5)
    await _drain(adm, tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_a_full_queue_displaces_its_last_request_for_a_higher_priority():
    adm = Admission(1, 2, 60.0)
    await adm.acquire()
    low = [asyncio.ensure_future(adm.acquire(0)) for _ in range(2)]
    while adm.queued < 2:
        await asyncio.sleep(0)
    # an equal priority finds the queue full
    with pytest.raises(RouterError) as err:
        await adm.acquire(0)
    assert err.value.status == 429 and "full" in err.value.message
    high = asyncio.ensure_future(adm.acquire(7))
    await asyncio.gather(low[1], return_exceptions=True)
    # the later low-priority arrival left with a 429; the earlier one still waits
    assert low[1].done() and isinstance(low[1].exception(), RouterError)
    assert low[1].exception().status == 429 and "higher priority" in low[1].exception().message
    assert not low[0].done() and adm.queued == 2 and adm.displaced == 1
    adm.release()
    await high
    assert not low[0].done()
    adm.release()
    await low[0]
    assert adm.queued == 0 and adm.active == 1


async def test_a_timed_out_or_cancelled_waiter_leaves_no_trace():
    adm = Admission(1, 5, 0.05)
    await adm.acquire()
    with pytest.raises(RouterError) as err:
        await adm.acquire(3)
    assert err.value.status == 429 and "longer than" in err.value.message
    adm.queue_timeout = 60.0
    t = asyncio.ensure_future(adm.acquire(1))
    while adm.queued < 1:
        await asyncio.sleep(0)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    assert adm.queued == 0 and adm.queued_by_priority() == {}
    adm.release()  # nobody waits: the slot is freed
    assert adm.active == 0


@pytest.mark.parametrize("headers, enabled, expect", [
    ({}, False, 0),
    ({}, True, 0),
    ({PRIORITY_HEADER: "12"}, True, 12),
    ({PRIORITY_HEADER: " -3 "}, True, -3),
])
def test_priority_header_values(headers, enabled, expect):
    assert request_priority(headers, enabled) == expect


@pytest.mark.parametrize("headers, enabled, needle", [
    ({PRIORITY_HEADER: "1"}, False, "--enable-priority-scheduling"),
    ({PRIORITY_HEADER: "high"}, True, "must be an integer"),
    ({PRIORITY_HEADER: str(2**40)}, True, "within"),
])
def test_bad_priority_headers_are_400_naming_the_header(headers, enabled, needle):
    with pytest.raises(RouterError) as err:
        request_priority(headers, enabled)
    assert err.value.status == 400 and err.value.param == PRIORITY_HEADER and needle in err.value.message
