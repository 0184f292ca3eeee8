"""The container image's recipe, checked without Docker (no engine runs in CI).

The entrypoint script is run for real with a stand-in ``python`` on PATH; the Dockerfile
and .dockerignore are checked as text: what the build copies exists and reaches the
build context, the variants install what the issue asks, the runtime user is not root.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import CHART_DIR, REPO_ROOT

ENTRYPOINT = REPO_ROOT / "docker" / "entrypoint.sh"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"


# ---- entrypoint ----

@pytest.fixture(scope="module")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python`` that prints its argv as JSON and exits with FAKE_PYTHON_RC."""
    bin_dir = tmp_path_factory.mktemp("bin")
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_PYTHON_ARGV"\nexit "${FAKE_PYTHON_RC:-0}"\n')
    fake.chmod(0o755)
    return bin_dir


def _run_entrypoint(fake_python: Path, tmp_path: Path, *args: str,
                    rc: int = 0) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    argv_file = tmp_path / "argv"
    sh = shutil.which("sh")
    assert sh, "POSIX sh is needed to run the entrypoint"
    env = {"PATH": f"{fake_python}{os.pathsep}{os.environ.get('PATH', '')}",
           "FAKE_PYTHON_ARGV": str(argv_file), "FAKE_PYTHON_RC": str(rc)}
    proc = subprocess.run([sh, str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=10)
    argv = argv_file.read_text().splitlines() if argv_file.exists() else []
    return proc, argv


@pytest.mark.parametrize("process", ["lb", "node_sidecar", "node_engine"])
def test_entrypoint_runs_the_named_process_with_its_flags(fake_python: Path, tmp_path: Path, process: str) -> None:
    proc, argv = _run_entrypoint(fake_python, tmp_path, process, "--host", "127.0.0.1", "--port", "30000",
                                 "--discover-dns", "mixed=a b:1", rc=3)
    assert argv == ["-m", process, "--host", "127.0.0.1", "--port", "30000", "--discover-dns", "mixed=a b:1"]
    assert proc.returncode == 3, "the process's exit status must be the container's"


@pytest.mark.parametrize("args", [(), ("bash",), ("handoff",), ("-m",)])
def test_entrypoint_refuses_anything_else(fake_python: Path, tmp_path: Path, args: tuple[str, ...]) -> None:
    proc, argv = _run_entrypoint(fake_python, tmp_path, *args)
    assert proc.returncode == 64
    assert argv == [], "nothing may run"
    assert "lb|node_sidecar|node_engine" in proc.stderr


def test_entrypoint_is_executable() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")


# ---- Dockerfile ----

def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: the last match wins, parents count."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]  # a/, a/b/, a/b/c
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        if pat.startswith("**/"):  # at any depth
            pat, candidates = pat[3:], parts
        else:  # anchored at the context's root
            candidates = prefixes
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            ignored = not negate
    return ignored


def test_dockerfile_builds_cuda_by_default_and_cpu_on_request() -> None:
    instructions = _instructions()
    first_from = next(i for i, ins in enumerate(instructions) if ins[0] == "FROM")
    global_args = dict(a[1].split("=", 1) for a in instructions[:first_from] if a[0] == "ARG" and "=" in a[1])
    assert global_args["VARIANT"] == "cuda"
    assert global_args["CUDA_BASE"].startswith("nvidia/cuda:")
    froms = [ins[1] for ins in instructions if ins[0] == "FROM"]
    assert "${CUDA_BASE} AS base-cuda" in froms and "${CPU_BASE} AS base-cpu" in froms
    assert froms[-1] == "base-${VARIANT} AS runtime"
    run = " ".join(ins[1] for ins in instructions if ins[0] == "RUN")
    args = dict(a[1].split("=", 1) for a in instructions if a[0] == "ARG" and "=" in a[1])
    makefile_pin = re.search(r"TORCH_PIN \?= torch==(\S+)", (REPO_ROOT / "Makefile").read_text())
    assert makefile_pin and args["TORCH_VERSION"] == makefile_pin.group(1) == "2.13.0"
    assert args["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    cuda = re.search(r"cuda\)(.*?);;", run)
    cpu = re.search(r"cpu\)(.*?);;", run)
    assert cuda and cpu
    assert 'pip install "torch==${TORCH_VERSION}"' in cuda.group(1) and '".[gpu]"' in cuda.group(1)
    assert '--index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"' in cpu.group(1)
    assert "[gpu]" not in cpu.group(1) and "pip install ." in cpu.group(1)


def test_dockerfile_runs_as_non_root_through_the_entrypoint() -> None:
    runtime = _stages()[-1]
    users = [ins[1] for ins in runtime if ins[0] == "USER"]
    assert users, "the runtime stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid lets runAsNonRoot verify it"
    chart_uid = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert int(uid) == chart_uid
    (entrypoint,) = [json.loads(ins[1]) for ins in runtime if ins[0] == "ENTRYPOINT"]
    copies = [ins[1].split() for ins in runtime if ins[0] == "COPY"]
    assert any(c[-2:] == ["docker/entrypoint.sh", entrypoint[0]] for c in copies)


def test_everything_the_build_copies_is_in_the_context() -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    sources = []
    for word, rest in _instructions():
        if word == "COPY" and "--from=" not in rest:
            parts = [p for p in rest.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert {"pyproject.toml", "README.md", "handoff", "lb", "node_sidecar", "node_engine",
            "docker/entrypoint.sh"} <= set(sources)
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    for debris in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "helm/handoff/Chart.yaml",
                   "lb/__pycache__/metrics.cpython-311.pyc"):
        assert _ignored(debris, patterns), f"{debris} would be sent to the Docker daemon"


def test_chart_app_version_is_the_project_version() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.M)
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert version and chart["appVersion"] == version.group(1)
