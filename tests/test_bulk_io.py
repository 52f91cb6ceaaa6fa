"""The bulk file threads (kernels/sandbox/bulk_io.py): one owner's stuck work holds at most its
share of them, another owner's work and the loop's default executor go on meanwhile, and no
lane outlives its work."""

from __future__ import annotations

import asyncio
import threading

from sandkernel.kernels.sandbox.bulk_io import BulkIO

WAIT = 30.0  # a liveness bound on events that come at once; never reached when the code is right


def test_one_owners_stuck_work_leaves_threads_to_another_and_to_the_default_executor():
    async def scenario() -> None:
        pool = BulkIO(threads=4, per_owner=2)
        release = threading.Event()
        running, most = 0, 0
        lock = threading.Lock()

        def stuck() -> str:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            try:
                if not release.wait(WAIT):
                    raise TimeoutError("never released")
                return "done"
            finally:
                with lock:
                    running -= 1

        alice = [asyncio.create_task(pool.run("alice", stuck)) for _ in range(6)]

        async def two_running() -> None:  # alice's first two are in; her other four wait for her slots
            while running < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(two_running(), WAIT)
        # bob's work and the default executor's run while every one of alice's calls is held
        assert await asyncio.wait_for(pool.run("bob", lambda: "bob's"), WAIT) == "bob's"
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "default"), WAIT) == "default"
        assert running == 2 and not any(task.done() for task in alice)
        assert pool.owners() == 1  # bob's lane went with his call
        release.set()
        assert await asyncio.wait_for(asyncio.gather(*alice), WAIT) == ["done"] * 6
        assert most == 2
        assert pool.owners() == 0

    asyncio.run(scenario())


def test_a_failing_call_raises_to_its_caller_and_frees_its_slot():
    async def scenario() -> None:
        pool = BulkIO(threads=1, per_owner=1)

        def fails() -> None:
            raise OSError("disk full")

        for _ in range(3):  # a slot that leaked would hang the second call
            try:
                await asyncio.wait_for(pool.run("alice", fails), WAIT)
            except OSError as err:
                assert str(err) == "disk full"
        assert pool.owners() == 0

    asyncio.run(scenario())


def test_a_call_given_up_on_keeps_its_slot_until_its_thread_ends():
    async def scenario() -> None:
        pool = BulkIO(threads=2, per_owner=1)
        release, started = threading.Event(), threading.Event()

        def stuck() -> None:
            started.set()
            release.wait(WAIT)

        first = asyncio.create_task(pool.run("alice", stuck))
        assert await asyncio.to_thread(started.wait, WAIT)
        first.cancel()
        second = asyncio.create_task(pool.run("alice", lambda: "second"))
        done, _ = await asyncio.wait({first, second}, timeout=0.2)
        assert not done  # the cancelled call still holds alice's one slot: her next call waits
        release.set()
        assert await asyncio.wait_for(second, WAIT) == "second"
        assert first.cancelled() and pool.owners() == 0

    asyncio.run(scenario())
