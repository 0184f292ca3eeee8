"""The scripted server the client tests talk to."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.procs import ServerProcess


@pytest.fixture(scope="module")
def server(proc_log_dir) -> Iterator[ServerProcess]:
    proc = ServerProcess("tests.support.scripted_app", [], log_dir=proc_log_dir, name="scripted")
    proc.start()
    yield proc
    proc.stop()
