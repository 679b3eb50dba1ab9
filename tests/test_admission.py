"""The drain gate: held requests wait for the reset, and give up (→ 503) when its budget runs out."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission import Admission


async def test_open_gate_admits_at_once() -> None:
    admission = Admission()
    assert await admission.admit() is True
    assert admission.inflight == 1
    admission.leave()
    assert admission.inflight == 0


async def test_held_request_goes_on_when_the_gate_is_released() -> None:
    admission = Admission()
    hold = admission.hold(budget_s=10)
    waiting = asyncio.create_task(admission.admit())
    await asyncio.sleep(0)
    assert admission.held == 1 and not waiting.done()
    admission.release(hold)
    assert await waiting is True
    assert admission.held == 0 and admission.inflight == 1


async def test_held_request_gives_up_when_the_budget_runs_out() -> None:
    admission = Admission()
    admission.hold(budget_s=0.05)
    assert await admission.admit() is False
    assert admission.held == 0 and admission.inflight == 0


async def test_wait_idle_returns_when_the_last_request_leaves() -> None:
    admission = Admission()
    await admission.admit()
    admission.hold(budget_s=10)
    drain = asyncio.create_task(admission.wait_idle(timeout_s=10))
    await asyncio.sleep(0)
    admission.leave()
    result = await drain
    assert result.inflight_at_start == 1 and result.inflight_at_end == 0


async def test_wait_idle_is_bounded_by_its_timeout() -> None:
    admission = Admission()
    await admission.admit()
    result = await admission.wait_idle(timeout_s=0.05)
    assert result.inflight_at_start == 1 and result.inflight_at_end == 1


async def test_requests_let_in_by_a_release_count_in_flight_before_they_run() -> None:
    """A reset that holds the gate right after another released it must drain what that one let in."""
    admission = Admission()
    first = admission.hold(budget_s=10)
    waiting = asyncio.create_task(admission.admit())
    await asyncio.sleep(0)
    admission.release(first)
    second = admission.hold(budget_s=10)  # the coalesced round, before the woken task has run
    assert admission.inflight == 1
    drain = asyncio.create_task(admission.wait_idle(timeout_s=10))
    assert await waiting is True  # let in by the first round, not held again by the second
    await asyncio.sleep(0)
    assert not drain.done()
    admission.leave()
    result = await drain
    assert result.inflight_at_start == 1 and result.inflight_at_end == 0
    admission.release(second)


async def test_each_hold_keeps_its_own_budget() -> None:
    """A later, shorter hold does not cut short a request held by a longer one."""
    admission = Admission()
    long_hold = admission.hold(budget_s=10)
    waiting = asyncio.create_task(admission.admit())
    await asyncio.sleep(0)
    short_hold = admission.hold(budget_s=0.01)
    await asyncio.sleep(0.05)
    assert not waiting.done() and admission.held == 1
    admission.release(short_hold)
    assert not waiting.done()  # the long hold still closes the gate
    admission.release(long_hold)
    assert await waiting is True and admission.inflight == 1


@pytest.mark.parametrize("cancel_lands_before_release", [True, False])
async def test_a_held_request_that_is_cancelled_is_not_counted(cancel_lands_before_release: bool) -> None:
    admission = Admission()
    hold = admission.hold(budget_s=10)
    waiting = asyncio.create_task(admission.admit())
    await asyncio.sleep(0)
    waiting.cancel()
    if cancel_lands_before_release:
        with pytest.raises(asyncio.CancelledError):
            await waiting
    admission.release(hold)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert admission.inflight == 0 and admission.held == 0
