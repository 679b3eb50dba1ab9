"""Shared fixtures: serve real aiohttp apps on loopback ports for each test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from tests.support.client import CLIENT_TIMEOUT
from tests.support.sidecar import SidecarFactory, non_loopback_ipv4, serve_app, serve_sidecar

# Property tests (hypothesis). A failing example is saved to the example database and is
# replayed first on every later run until it passes; CI may keep the database between runs
# by pointing CACHEWITNESS_HYPOTHESIS_DB at a cached directory, and prints each failure's
# reproduction blob (`@reproduce_failure`) in the log either way. `dev` (the default) runs
# a few hundred examples per property; `ci` (`make test`: --hypothesis-profile=ci) 10,000.
# No deadline: one example may carry a 2 MiB event, and a timing is not a failure.
_EXAMPLES = DirectoryBasedExampleDatabase(
    os.environ.get("CACHEWITNESS_HYPOTHESIS_DB", ".hypothesis/examples")
)
_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "dev", max_examples=300, deadline=None, database=_EXAMPLES, suppress_health_check=_SLOW_DATA
)
settings.register_profile(
    "ci",
    max_examples=10_000,
    deadline=None,
    database=_EXAMPLES,
    print_blob=True,
    suppress_health_check=_SLOW_DATA,
)
settings.load_profile("dev")

# The suite's per-test bound (pyproject's `timeout`, 120 s) fires inside a property's example when
# the `ci` profile's 10,000 examples run on a loaded machine: hypothesis then reports the cut as a
# flaky example. A property test's bound is its examples' time, not a hang's: 900 s.
_PROPERTY_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Raise the bound of every hypothesis test (one without a `timeout` mark of its own)."""
    for item in items:
        function = getattr(item, "function", None)
        if getattr(function, "is_hypothesis_test", False) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(_PROPERTY_TIMEOUT_S))


@pytest.fixture
def remote_host() -> str:
    """A non-loopback address of this machine to bind a sidecar on (skips without one)."""
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    return address


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain client session."""
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        yield session


@pytest.fixture
def upstream_app() -> web.Application:
    """The controllable test upstream (tests/support/upstream.py)."""
    from tests.support.upstream import build_upstream

    return build_upstream()


@pytest.fixture
async def upstream(upstream_app: web.Application) -> AsyncIterator[str]:
    """The test upstream served on a loopback port."""
    async with serve_app(upstream_app) as url:
        yield url


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[SidecarFactory]:
    """Start sidecars in front of a given upstream: `url = await sidecar(upstream, **settings)`."""
    async with AsyncExitStack() as started:

        async def start(upstream: str, **overrides: Any) -> str:
            return (await started.enter_async_context(serve_sidecar(upstream, tmp_path, **overrides))).url

        yield start
