"""stop_task: a stop() returns even when its task absorbs a cancel, and a task's error is not lost."""

from __future__ import annotations

import asyncio

import pytest

from streams.tasks import stop_task, stop_tasks


async def test_a_task_that_absorbs_a_cancel_is_cancelled_again_until_it_ends() -> None:
    absorbed = 0

    async def stubborn() -> None:
        nonlocal absorbed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                absorbed += 1
                if absorbed == 3:
                    raise
                # a library that catches the cancel and polls on (what a single cancel+await hangs on)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await stop_task(task, recancel_s=0.02)
    assert task.cancelled() and absorbed == 3


async def test_a_task_that_failed_raises_its_error_unless_told_to_swallow_it() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    a, b = asyncio.create_task(fails()), asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await stop_task(a)
    await stop_task(b, swallow_errors=True)
    await stop_task(None)


async def test_every_task_is_stopped_even_when_one_failed() -> None:
    async def fails() -> None:
        raise KeyError("first")

    async def sleeps() -> None:
        await asyncio.sleep(60)

    tasks = [asyncio.create_task(fails()), asyncio.create_task(sleeps()), asyncio.create_task(sleeps())]
    await asyncio.sleep(0)
    with pytest.raises(KeyError):
        await stop_tasks(tasks)
    assert all(t.done() for t in tasks) and tasks[1].cancelled() and tasks[2].cancelled()
