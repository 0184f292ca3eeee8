"""Every bad flag value of ``python -m lb`` is a one-line error naming the flag, exit 2, before it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.procs import assert_refused_at_start
from tests.support.refusals import RefusalRunner, refusal_runner

# (the flag the message must name, the arguments, the environment); {tmp} is a folder of the test's own
CASES = [
    ("--discover-interval", ["--discover-interval", "0"], {}),
    ("--discover-interval", ["--discover-interval", "nan"], {}),
    ("--discover-interval", ["--discover-interval", "inf"], {}),
    ("--discover-interval", ["--discover-interval", "-inf"], {}),
    ("--discover-interval", ["--discover-interval", "ten"], {}),
    ("--control-timeout", ["--control-timeout", "-1"], {}),
    ("--control-timeout", ["--control-timeout", "inf"], {}),
    ("--weight-sync-timeout", ["--weight-sync-timeout", "700", "--max-control-timeout", "600"], {}),
    ("--max-control-timeout", ["--max-control-timeout", "inf"], {}),
    ("--generate-timeout", ["--generate-timeout", "inf"], {}),
    ("--connect-timeout", ["--connect-timeout", "inf"], {}),
    ("--health-interval", ["--health-interval", "nan"], {}),
    ("--health-timeout", ["--health-timeout", "inf"], {}),
    ("--unhealthy-threshold", ["--unhealthy-threshold", "1.5"], {}),
    ("--healthy-threshold", ["--healthy-threshold", "0"], {}),
    ("--max-nodes", ["--max-nodes", "0"], {}),
    ("--max-nodes", ["--max-nodes", "1", "--node", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], {}),
    ("--max-body-bytes", ["--max-body-bytes", "-1"], {}),
    ("--max-answer-bytes", ["--max-answer-bytes", "1e30"], {}),
    ("--header-timeout", ["--header-timeout", "0"], {}),
    ("--header-timeout", ["--header-timeout", "nan"], {}),
    ("--header-timeout", ["--header-timeout", "-1"], {}),
    ("--body-timeout", ["--body-timeout", "inf"], {}),
    ("--shutdown-timeout", ["--shutdown-timeout", "-1"], {}),
    ("--max-connections", ["--max-connections", "0"], {}),
    ("--max-buffered-body-bytes", ["--max-buffered-body-bytes", "1"], {}),
    ("--port", ["--port", "65536"], {}),
    ("--host", ["--host", ""], {}),
    ("--port-file", ["--port-file", "{tmp}"], {}),
    ("--port-file", ["--port-file", "{tmp}/missing/port"], {}),
    ("--policy", ["--policy", "ROUND_ROBIN"], {}),
    ("--log-level", ["--log-level", "INFO"], {}),
    ("--prefill", ["--prefill", "http://127.0.0.1:1@0"], {}),
    ("--discover-dns", ["--discover-dns", "MIXED=svc:8000"], {}),
    ("--discover-dns", ["--discover-dns", "mixed=svc:8000", "--discover-dns", "mixed=svc:8000"], {}),
    ("--admin-token", ["--admin-token", "  "], {}),
    ("--admin-token", [], {"HANDOFF_ADMIN_TOKEN": " "}),
    ("--api-key", ["--api-key", "s\u00e9cret"], {}),
    # review G: an address no node can have was looked up forever, every address left out; /proc, as root
    ("--discover-dns", ["--discover-dns", "mixed=0.0.0.0:8000"], {}),
    ("--discover-dns", ["--discover-dns", "decode=[ff02::1]:8000"], {}),
    ("--port-file", ["--port-file", "/proc/handoff-review-port"], {}),
    # review, stop 42: "0" is 0.0.0.0 to the resolver; "²" passed str.isdigit and int() refused it in its own words
    ("--discover-dns", ["--discover-dns", "mixed=0:8000"], {}),
    ("--prefill", ["--prefill", "http://127.0.0.1:1@\u00b2"], {}),
    ("--discover-dns", ["--discover-dns", "mixed=svc:\u00b2"], {}),
]


@pytest.fixture(scope="module")
def lb_runner() -> Iterator[RefusalRunner]:
    yield from refusal_runner("lb")


@pytest.mark.parametrize(("flag", "args", "env"), CASES, ids=[" ".join(c[1]) or str(c[2]) for c in CASES])
def test_a_bad_flag_value_stops_the_lb_naming_the_flag(flag: str, args: list[str], env: dict[str, str],
                                                       tmp_path: Path, lb_runner: RefusalRunner) -> None:
    argv = ["lb", "--port", "0", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert_refused_at_start(argv, flag, env=env, timeout_s=20, runner=lb_runner)


def test_python_m_lb_itself_refuses_a_bad_flag_value() -> None:
    """The table runs in forks of one process (tests/support/refusal_runner.py); the entry point itself, in a fresh
    interpreter, refuses as they do."""
    assert_refused_at_start(["lb", "--port", "0", "--max-nodes", "0"], "--max-nodes", timeout_s=20)
    assert_refused_at_start(["lb", "--port", "0"], "--admin-token", env={"HANDOFF_ADMIN_TOKEN": " "}, timeout_s=20)


def test_the_runner_reports_a_value_taken_as_started(lb_runner: RefusalRunner) -> None:
    """A flag value the LB took (here: none is bad) shows as a start, the LB killed, and the runner serves on."""
    with pytest.raises(AssertionError, match=r"started: still running after 2 s; its stderr ends:\n"):
        assert_refused_at_start(["lb", "--port", "0", "--host", "127.0.0.1"], "--port", timeout_s=2, runner=lb_runner)
    assert_refused_at_start(["lb", "--port", "0", "--max-nodes", "0"], "--max-nodes", timeout_s=20, runner=lb_runner)


def test_the_runner_keeps_both_ends_of_a_long_stderr() -> None:
    from tests.support.refusal_runner import STDERR_KEEP, _Tail

    tail = _Tail()
    tail.add(b"first\n" + b"x" * (3 * STDERR_KEEP))
    tail.add(b"\nlast line\n")
    text = tail.text()
    assert text.startswith("first\n") and text.endswith("\nlast line\n") and len(text) < 2 * STDERR_KEEP + 100
    assert f"[... {STDERR_KEEP + 6 + 11} bytes left out ...]" in text, text[STDERR_KEEP - 10:STDERR_KEEP + 60]
