"""The drain gate: held requests wait for the reset, and give up (→ 503) when its budget runs out."""

from __future__ import annotations

import asyncio

from proxy.admission import Admission


async def test_open_gate_admits_at_once() -> None:
    admission = Admission()
    assert await admission.admit() is True
    assert admission.inflight == 1
    admission.leave()
    assert admission.inflight == 0


async def test_held_request_goes_on_when_the_gate_is_released() -> None:
    admission = Admission()
    admission.hold(budget_s=10)
    waiting = asyncio.create_task(admission.admit())
    await asyncio.sleep(0)
    assert admission.held == 1 and not waiting.done()
    admission.release()
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
