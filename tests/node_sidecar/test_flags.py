"""Every bad flag value of ``python -m node_sidecar`` is a one-line error naming the flag, exit 2, before it
serves."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.procs import assert_refused_at_start
from tests.support.refusals import RefusalRunner, refusal_runner

ENGINE_URL = "http://127.0.0.1:9"
# (the flag the message must name, the arguments, the environment); {tmp} is a folder of the test's own
CASES = [
    ("--engine-url", ["--engine-url", ""], {}),
    ("--engine-url", ["--engine-url", "http://"], {}),
    ("--engine-url", ["--engine-url", "http://127.0.0.1:99999"], {}),
    ("--engine-url", ["--engine-url", "http://user:pw@127.0.0.1:1"], {}),
    ("--engine-url", ["--engine-url", "http://h\u00e9:1"], {}),
    ("--engine-url", ["--engine-url", "http://127.0.0.1:1?x=1"], {}),
    ("--engine-url", ["--engine-url", "https://127.0.0.1:1"], {}),
    ("--hold-timeout", ["--hold-timeout", "inf"], {}),
    ("--hold-timeout", ["--hold-timeout", "nan"], {}),
    ("--pause-hold-timeout", ["--pause-hold-timeout", "inf"], {}),
    ("--drain-timeout", ["--drain-timeout", "0"], {}),
    ("--drain-timeout", ["--drain-timeout", "100", "--max-drain-timeout", "50"], {}),
    ("--max-drain-timeout", ["--max-drain-timeout", "inf"], {}),
    ("--generate-timeout", ["--generate-timeout", "inf"], {}),
    ("--control-timeout", ["--control-timeout", "inf"], {}),
    ("--engine-poll-interval", ["--engine-poll-interval", "inf"], {}),
    ("--hold-timeout", ["--hold-timeout", "1e300"], {}),  # "never" without a word (found by review)
    ("--engine-health-timeout", ["--engine-health-timeout", "inf"], {}),
    ("--vllm-weight-sync-timeout", ["--vllm-weight-sync-timeout", "inf"], {}),
    ("--vllm-sleep-level", ["--vllm-sleep-level", "3"], {}),
    ("--hold-max", ["--hold-max", "0"], {}),
    ("--hold-max", ["--hold-max", "1.5"], {}),
    ("--pause-hold-max", ["--pause-hold-max", "-1"], {}),
    ("--hold-max-bytes", ["--hold-max-bytes", "0"], {}),
    ("--engine-health-misses", ["--engine-health-misses", "0"], {}),
    ("--retry-after", ["--retry-after", "0"], {}),
    ("--max-body-bytes", ["--max-body-bytes", "0"], {}),
    ("--max-answer-bytes", ["--max-answer-bytes", "0"], {}),
    ("--role", ["--role", "MIXED"], {}),
    ("--engine-kind", ["--engine-kind", "VLLM"], {}),
    ("--header-timeout", ["--header-timeout", "0"], {}),
    ("--body-timeout", ["--body-timeout", "inf"], {}),
    ("--host", ["--host", ""], {}),
    ("--port-file", ["--port-file", "{tmp}"], {}),
    ("--state-file", ["--state-file", "{tmp}/no-such-folder/intent.json"], {}),
    ("--state-file", ["--state-file", "{tmp}"], {}),
    ("--admin-token", ["--admin-token", " "], {}),
    ("--api-key", [], {"HANDOFF_API_KEY": "t\u00f6k"}),
    # review G: Path("") is the current folder; a folder no file can be made in (/proc, as root) was taken
    ("--allowed-local-media-path", ["--allowed-local-media-path", ""], {}),
    ("--state-file", ["--state-file", "/proc/handoff-review-intent.json"], {}),
]


@pytest.fixture(scope="module")
def sidecar_runner() -> Iterator[RefusalRunner]:
    yield from refusal_runner("node_sidecar")


@pytest.mark.parametrize(("flag", "args", "env"), CASES, ids=[" ".join(c[1]) or str(c[2]) for c in CASES])
def test_a_bad_flag_value_stops_the_sidecar_naming_the_flag(flag: str, args: list[str], env: dict[str, str],
                                                            tmp_path: Path, sidecar_runner: RefusalRunner) -> None:
    url = [] if "--engine-url" in args else ["--engine-url", ENGINE_URL]
    argv = ["node_sidecar", "--port", "0", *url, *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert_refused_at_start(argv, flag, env=env, timeout_s=20, runner=sidecar_runner)


def test_python_m_node_sidecar_itself_refuses_a_bad_flag_value() -> None:
    """The table runs in forks of one process (tests/support/refusal_runner.py); the entry point itself, in a fresh
    interpreter, refuses as they do."""
    assert_refused_at_start(["node_sidecar", "--port", "0", "--engine-url", "http://"], "--engine-url", timeout_s=20)
    assert_refused_at_start(["node_sidecar", "--port", "0", "--engine-url", ENGINE_URL], "--api-key",
                            env={"HANDOFF_API_KEY": "t\u00f6k"}, timeout_s=20)
