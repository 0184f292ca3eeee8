"""Shared fixtures: GPU marker handling and a log directory for real processes."""

from __future__ import annotations

import pytest


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
