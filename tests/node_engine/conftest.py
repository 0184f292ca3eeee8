"""A built-in tiny engine on loopback, shared by the modules of this package that only generate."""

from __future__ import annotations

import pytest

from tests.support.procs import ServerProcess


@pytest.fixture(scope="package")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--max-total-tokens", "4096",
                                         "--max-running-requests", "16"], log_dir=tmp_path_factory.mktemp("engine"))
    proc.start()
    yield proc
    proc.stop()
