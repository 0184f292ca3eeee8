"""Shared fixtures: GPU marker handling, one torch thread in-process, a log directory for real processes."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread for the engines a test runs in its own process. They share the cores with the other
    worker and with every engine process the tests start; OpenMP's spinning threads then cost the in-process
    tests several times their time (`test_interleavings` 2.5 s alone, 10 s beside two busy cores with two
    threads, 3 s with one; past its 120 s timeout beside the whole suite)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def proc_log_dir(tmp_path_factory: pytest.TempPathFactory):
    """A directory for the logs and port files of the processes a module starts."""
    return tmp_path_factory.mktemp("procs")
