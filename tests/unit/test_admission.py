"""Admission on its own: which waiter gets a freed slot (the highest priority, the earliest first), no sockets."""

from __future__ import annotations

import asyncio

import pytest
from conftest import assert_eventually

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.admission import Admission
from iop_wire.errors import IopError


async def _slots_in_order(priorities: dict[str, int]) -> list[str]:
    """Names in the order they got a slot: one run holds the only slot while these queue, in this order."""
    admission = Admission("m", capacity=1, queue_size=len(priorities), on_change=lambda _: None)
    await admission.acquire(0)  # the run holding the slot
    served: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await admission.acquire(priority)
        served.append(name)

    tasks = []
    for name, priority in priorities.items():
        tasks.append(asyncio.create_task(wait(name, priority)))
        await assert_eventually(lambda: admission.queued == len(tasks))  # queued before the next one arrives
    for _ in priorities:
        admission.release()  # one slot at a time: one waiter runs, then the next release
        await assert_eventually(lambda: admission.queued + len(served) == len(priorities))  # it took the slot
    await asyncio.gather(*tasks)
    return served


async def test_waiters_of_one_priority_get_slots_first_come_first_served() -> None:
    names = [f"w{index}" for index in range(5)]
    assert await _slots_in_order(dict.fromkeys(names, 0)) == names


async def test_a_higher_priority_goes_first_and_equals_keep_their_arrival_order() -> None:
    priorities = {"a": 0, "b": 5, "c": 0, "d": 5, "e": -1, "f": 5}
    assert await _slots_in_order(priorities) == ["b", "d", "f", "a", "c", "e"]


async def test_a_full_queue_refuses_with_resource_exhausted() -> None:
    admission = Admission("m", capacity=1, queue_size=1, on_change=lambda _: None)
    await admission.acquire(0)
    waiting = asyncio.create_task(admission.acquire(0))
    await assert_eventually(lambda: admission.queued == 1)
    with pytest.raises(IopError) as caught:
        await admission.acquire(9)
    assert caught.value.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    admission.release()
    await waiting
    assert (admission.in_flight, admission.queued) == (1, 0)
