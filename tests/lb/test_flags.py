"""Every bad flag value of ``python -m lb`` is a one-line error naming the flag, exit 2, before it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import assert_refused_at_start

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


@pytest.mark.parametrize(("flag", "args", "env"), CASES, ids=[" ".join(c[1]) or str(c[2]) for c in CASES])
def test_a_bad_flag_value_stops_the_lb_naming_the_flag(flag: str, args: list[str], env: dict[str, str],
                                                       tmp_path: Path) -> None:
    argv = ["lb", "--port", "0", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert_refused_at_start(argv, flag, env=env, timeout_s=20)
