"""Fixtures for the LB tests: fake nodes on a background loop, and the LB as a real process."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import FAST_HEALTH, LB
from tests.support.procs import ServerProcess

_lb_numbers = itertools.count()


@pytest.fixture
def fakes() -> Iterator[FakeCluster]:
    with FakeCluster() as cluster:
        yield cluster


@pytest.fixture
def start_lb(proc_log_dir: Path) -> Iterator[Callable[..., LB]]:
    """``start_lb(*args, env=..., module=...)``: an LB process, stopped at the end of the test."""
    started: list[LB] = []

    def start(*args: str, env: dict[str, str] | None = None, module: str = "lb", fast_health: bool = True) -> LB:
        argv = [*args, *(FAST_HEALTH if fast_health else [])]
        proc = ServerProcess(module, argv, log_dir=proc_log_dir, name=f"lb{next(_lb_numbers)}", env=env)
        lb = LB(proc.start(timeout=30))
        started.append(lb)
        return lb

    yield start
    for lb in started:
        lb.close()


@pytest.fixture(scope="module")
def module_fakes() -> Iterator[FakeCluster]:
    with FakeCluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_lb(proc_log_dir: Path) -> Iterator[LB]:
    """One LB for a whole module; tests set its members with :func:`tests.lb.lbproc.set_members`."""
    proc = ServerProcess("lb", FAST_HEALTH, log_dir=proc_log_dir, name=f"lb{next(_lb_numbers)}")
    lb = LB(proc.start(timeout=30))
    yield lb
    lb.close()
