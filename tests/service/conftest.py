"""The shared service plumbing runs on uvloop in the services and on asyncio in tools: test both."""

from __future__ import annotations

import asyncio
from typing import Callable, Mapping

import pytest

from handoff.service.upstream import UpstreamClient


@pytest.hookimpl(optionalhook=True)  # pytest-asyncio >= 1.4 has the hook; older ones run asyncio only
def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture
async def client():
    """One upstream client for the test, closed after it."""
    c = UpstreamClient()
    yield c
    await c.aclose()
