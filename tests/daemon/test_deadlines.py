"""Read deadlines kept by one ticker (daemon/deadlines.py): an overrun read is cancelled and told
apart from any other cancellation; activity that moves the deadline keeps it from firing."""

from __future__ import annotations

import asyncio

import pytest

from gpusched.daemon.deadlines import Deadline, Deadlines


def test_a_read_that_overruns_is_cancelled_and_the_connection_goes_on() -> None:
    async def main() -> tuple[bool, int, float]:
        deadlines = Deadlines(lambda: 0.01)
        reader = asyncio.StreamReader()  # nobody ever writes: the read waits for ever
        deadline = deadlines.watch()
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline.arm(0.05)
        try:
            await reader.readexactly(1)
            fired = False
        except asyncio.CancelledError:
            fired = deadline.fired()
        waited = loop.time() - began
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()  # taken back: 0, so a later asyncio.timeout in the task still works
        deadlines.forget(deadline)
        await deadlines.close()
        return fired, cancelling, waited

    fired, cancelling, waited = asyncio.run(main())
    assert fired and cancelling == 0
    assert 0.05 <= waited < 5


def test_a_cancel_from_elsewhere_is_not_mistaken_for_a_deadline() -> None:
    async def reading(deadlines: Deadlines, seen: list[bool]) -> None:
        deadline = deadlines.watch()
        deadline.arm(3600)
        try:
            await asyncio.StreamReader().readexactly(1)
        except asyncio.CancelledError:
            seen.append(deadline.fired())
            raise
        finally:
            deadlines.forget(deadline)

    async def main() -> list[bool]:
        deadlines = Deadlines(lambda: 0.01)
        seen: list[bool] = []
        task = asyncio.create_task(reading(deadlines, seen))
        await asyncio.sleep(0.05)
        task.cancel()  # the server shutting down, say
        with pytest.raises(asyncio.CancelledError):
            await task
        await deadlines.close()
        return seen

    assert asyncio.run(main()) == [False]


def test_only_an_armed_deadline_that_has_passed_fires() -> None:
    """The ticker's rule, without the ticker: `_expire(now)` is what each tick runs."""

    async def main() -> list[tuple[str, bool]]:
        loop = asyncio.get_running_loop()
        out: list[tuple[str, bool]] = []
        task = asyncio.create_task(asyncio.sleep(3600))
        deadline = Deadline(task, loop)
        now = loop.time()
        deadline._expire(now + 1e9)
        out.append(("unarmed", deadline.fired()))
        deadline.arm(10)
        deadline._expire(now + 5)
        out.append(("armed, not yet due", deadline.fired()))
        deadline.arm(10)  # activity: the deadline moves on
        deadline._expire(loop.time() + 9)
        out.append(("moved on", deadline.fired()))
        deadline._expire(loop.time() + 11)
        deadline._expire(loop.time() + 12)  # fires once, not once per tick
        out.append(("due", deadline.fired()))
        out.append(("asked again", deadline.fired()))
        deadline._expire(loop.time() + 13)  # disarmed by firing: it does not fire again on its own
        out.append(("after firing", deadline.fired()))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return out

    assert asyncio.run(main()) == [("unarmed", False), ("armed, not yet due", False), ("moved on", False),
                                   ("due", True), ("asked again", False), ("after firing", False)]


def test_the_ticker_stops_when_no_connection_is_watched() -> None:
    async def main() -> bool:
        deadlines = Deadlines(lambda: 0.01)
        deadline = deadlines.watch()
        ticker = deadlines._ticker
        assert ticker is not None and not ticker.done()
        deadlines.forget(deadline)
        await asyncio.wait_for(ticker, 5)  # it ends on its own at its next tick
        again = deadlines.watch()  # a new connection starts a new one
        running = deadlines._ticker is not ticker and not deadlines._ticker.done()  # type: ignore[union-attr]
        deadlines.forget(again)
        await deadlines.close()
        return running

    assert asyncio.run(main())


def test_a_shutdown_cancel_in_the_same_turn_as_the_deadline_is_not_swallowed() -> None:
    """The ticker and Server.close may both cancel a connection before it runs again: the one
    CancelledError it sees then must stay a cancellation, not become a timeout."""

    async def reading(deadline_holder: list[Deadline], outcome: list[str]) -> None:
        deadlines = Deadlines(lambda: 3600)  # the test calls _expire itself
        deadline = deadlines.watch()
        deadline_holder.append(deadline)
        deadline.arm(0)
        try:
            await asyncio.StreamReader().readexactly(1)
        except asyncio.CancelledError:
            if not deadline.fired():
                outcome.append("cancelled")
                raise
            outcome.append("timed out")
        finally:
            deadlines.forget(deadline)
            await deadlines.close()

    async def main() -> list[str]:
        holder: list[Deadline] = []
        outcome: list[str] = []
        task = asyncio.create_task(reading(holder, outcome))
        await asyncio.sleep(0)  # it is waiting in its read now
        holder[0]._expire(asyncio.get_running_loop().time() + 1)  # the ticker...
        task.cancel()  # ...and the server's shutdown, before the task runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        return outcome

    assert asyncio.run(main()) == ["cancelled"]
