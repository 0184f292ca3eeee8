"""The re-exec with torch_memory_saver preloaded (issue 18, item 1), on a machine without CUDA.

The preload library of torch_memory_saver needs ``libcudart.so.12`` and has no RPATH; a pip-installed torch
keeps that under ``site-packages/nvidia/*/lib``, which the loader does not search, so the re-executed engine
died in the loader (exit 127) before Python started. Here a library built for the test plays the preload
library (it needs ``libfakecudart.so.12``, kept in a fake ``nvidia/cuda_runtime/lib`` folder) and the fake
torch_memory_saver of ``tests/support/fake_tms`` hands it out.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from node_engine.launch import cuda_library_dirs, preload_environment
from tests.support.procs import REPO_ROOT

FAKE_TMS = REPO_ROOT / "tests" / "support" / "fake_tms"
CC = shutil.which("cc") or shutil.which("gcc")


def test_the_reexec_environment_finds_the_cuda_wheels_first() -> None:
    env = preload_environment({"LD_LIBRARY_PATH": "/opt/mine:/wheel/a/lib", "PATH": "/bin"}, "/x/tms.so",
                              ["/wheel/a/lib", "/wheel/b/lib"])
    assert env["LD_LIBRARY_PATH"] == "/wheel/a/lib:/wheel/b/lib:/opt/mine"
    assert env["LD_PRELOAD"] == "/x/tms.so" and env["PATH"] == "/bin"
    assert env["TMS_RETAIN_CPU_BACKUP"] == "1" and env["HANDOFF_TMS_PRELOADED"] == "1"
    assert "LD_LIBRARY_PATH" not in preload_environment({}, "/x/tms.so", [])


def test_the_cuda_wheels_library_folders_are_found_on_sys_path(tmp_path: Path, monkeypatch) -> None:
    for name in ("cuda_runtime", "cublas"):
        (tmp_path / "nvidia" / name / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / "cuda_runtime" / "include").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    found = cuda_library_dirs()
    assert str(tmp_path / "nvidia" / "cuda_runtime" / "lib") in found
    assert str(tmp_path / "nvidia" / "cublas" / "lib") in found
    assert not any(d.endswith("include") for d in found)


@pytest.fixture(scope="module")
def fake_wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a site folder holding ``nvidia/cuda_runtime/lib/libfakecudart.so.12``, a preload library needing it)."""
    if CC is None:
        pytest.skip("needs a C compiler to build the stand-in libraries")
    root = tmp_path_factory.mktemp("wheels")
    lib_dir = root / "site" / "nvidia" / "cuda_runtime" / "lib"
    lib_dir.mkdir(parents=True)
    (root / "rt.c").write_text("int fake_cudart_version(void) { return 12; }\n")
    (root / "pre.c").write_text("extern int fake_cudart_version(void);\nint hook(void) { return fake_cudart_version(); }\n")
    subprocess.run([CC, "-shared", "-fPIC", "-Wl,-soname,libfakecudart.so.12", "-o",
                    str(lib_dir / "libfakecudart.so.12"), str(root / "rt.c")], check=True, timeout=60)
    preload = root / "torch_memory_saver_hook_mode_preload_fake.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(preload), str(root / "pre.c"), f"-L{lib_dir}",
                    "-l:libfakecudart.so.12"], check=True, timeout=60)
    return root / "site", preload


def start_cuda_engine(preload: Path, *python_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "HANDOFF_TMS_PRELOADED")}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in (*python_path, FAKE_TMS, REPO_ROOT)),
               FAKE_TMS_PRELOAD=str(preload))
    return subprocess.run([sys.executable, "-m", "node_engine", "--model-path", "builtin:tiny", "--device", "cuda",
                           "--enable-memory-saver"], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_reexeced_engine_gets_past_the_loader(fake_wheels: tuple[Path, Path]) -> None:
    site, preload = fake_wheels
    run = start_cuda_engine(preload, site)
    output = run.stdout + run.stderr
    assert "re-executing with torch_memory_saver preloaded" in output, output
    assert str(site / "nvidia" / "cuda_runtime" / "lib") in output
    # The new process started Python and got as far as looking for a GPU (this machine has none).
    assert run.returncode == 2 and "CUDA is not available" in output, output


def test_a_preload_the_loader_refuses_is_a_clear_start_error(fake_wheels: tuple[Path, Path]) -> None:
    _, preload = fake_wheels
    run = start_cuda_engine(preload)  # no CUDA wheels anywhere: the loader cannot find libfakecudart.so.12
    output = run.stdout + run.stderr
    assert run.returncode == 2, output  # not 127 from the loader of a process that never started
    assert "cannot start" in output and "libfakecudart.so.12" in output and "LD_LIBRARY_PATH" in output, output
    assert "re-executing" not in output
