"""The operator's work queue: a key waits once, is never processed twice at once, and comes back
after its processing when it was asked for meanwhile."""

from __future__ import annotations

import asyncio

from kuberl_operator.workqueue import WorkQueue


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_key_asked_for_many_times_while_it_waits_is_processed_once():
    async def scenario() -> list[str]:
        done: list[str] = []

        async def process(key: str) -> None:
            done.append(key)

        queue: WorkQueue[str] = WorkQueue(process)
        for key in ["a", "b", "a", "a", "c", "b"]:
            queue.add(key)
        assert len(queue) == 3
        queue.start(2, "test")
        while len(done) < 3 or len(queue):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await queue.stop()
        return done

    assert run(scenario()) == ["a", "b", "c"]


def test_a_key_asked_for_while_processed_runs_again_after_and_never_twice_at_once():
    async def scenario() -> tuple[list[str], int]:
        events: list[str] = []
        running: dict[str, int] = {"a": 0}
        most = 0
        release = asyncio.Event()

        async def process(key: str) -> None:
            nonlocal most
            running[key] += 1
            most = max(most, running[key])
            events.append(f"start {key}")
            if len([e for e in events if e == "start a"]) == 1:
                await release.wait()  # the first run waits while more requests arrive
            events.append(f"end {key}")
            running[key] -= 1

        queue: WorkQueue[str] = WorkQueue(process)
        queue.start(4, "test")  # idle workers that could take "a" a second time
        queue.add("a")
        await asyncio.sleep(0.02)
        queue.add("a")
        queue.add("a")
        await asyncio.sleep(0.02)
        assert events == ["start a"]  # not started again while the first runs
        release.set()
        while events.count("end a") < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await queue.stop()
        return events, most

    events, most = run(scenario())
    assert events == ["start a", "end a", "start a", "end a"]  # once more, not twice more
    assert most == 1


def test_a_failing_process_does_not_stop_its_worker():
    async def scenario() -> list[str]:
        done: list[str] = []

        async def process(key: str) -> None:
            if key == "bad":
                raise RuntimeError("boom")
            done.append(key)

        queue: WorkQueue[str] = WorkQueue(process)
        queue.start(1, "test")
        queue.add("bad")
        queue.add("good")
        while not done:
            await asyncio.sleep(0.01)
        await queue.stop()
        return done

    assert run(scenario()) == ["good"]
