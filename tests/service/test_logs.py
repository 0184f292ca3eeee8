"""The log plumbing's pure parts: one line per event, the rate limit, command lines written without tokens."""

from __future__ import annotations

import io
import json
import logging
from contextlib import redirect_stderr

import pytest

from handoff.cluster.process import _redacted
from handoff.service.logs import MAX_TRACEBACK_CHARS, TRACEBACK_INDENT, RateLimit, one_line, setup_logging


def record(msg: str, *args: object, name: str = "t") -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_one_line_escapes_every_line_breaker() -> None:
    text = one_line("a\nb\rc\x1b[2Jd\x85e\u2028f\tg\x00h é")
    assert text == "a\\nb\\rc\\x1b[2Jd\\x85e\\u2028f\\tg\\x00h é"
    assert text.isprintable()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_message_with_line_breaks_is_one_line(fmt: str) -> None:
    stream = io.StringIO()
    with redirect_stderr(stream):
        setup_logging("test", fmt=fmt, secrets=["tok-1"])
        logging.getLogger("one-line-test").warning("peer said %s", "x\r\n12:00:00 INFO forged tok-1\x1b[2J")
    logging.getLogger().handlers.clear()
    [line] = stream.getvalue().splitlines()
    assert "\x1b" not in line and "tok-1" not in line
    if fmt == "json":
        assert json.loads(line)["msg"] == "peer said x\r\n12:00:00 INFO forged ***\x1b[2J"


def test_rate_limit_lets_a_burst_through_then_counts_what_it_dropped() -> None:
    now = [0.0]
    limit = RateLimit(burst=3, window_s=60.0, clock=lambda: now[0])
    assert [limit.filter(record("bad request %s", i)) for i in range(5)] == [True, True, True, False, False]
    assert limit.filter(record("another template"))  # each template has its own window
    assert limit.filter(record("bad request %s", 9, name="other"))  # and each logger
    now[0] = 60.0
    summary = record("bad request %s", 5)
    assert limit.filter(summary)
    assert summary.getMessage() == "bad request 5 (2 more like this in the 60 s before were not logged)"
    following = record("bad request %s", 6)
    assert limit.filter(following) and following.getMessage() == "bad request 6"


def test_rate_limit_holds_a_bounded_number_of_templates() -> None:
    limit = RateLimit(burst=1, window_s=60.0, clock=lambda: 0.0)
    for i in range(10 * RateLimit.MAX_TEMPLATES):
        limit.filter(record(f"formatted by its caller {i}"))
    assert len(limit._windows) <= RateLimit.MAX_TEMPLATES + 1


@pytest.mark.parametrize("argv", [
    ["--admin-token", "s3cret"], ["--admin-token=s3cret"], ["--api-key=s3cret"], ["--api-k", "s3cret"],
    ["--admin-tok=s3cret"],
])
def test_the_command_line_shown_hides_every_spelling_of_a_token(argv: list[str]) -> None:
    shown = _redacted(["python", "-m", "lb", *argv, "--port", "0"])
    assert not any("s3cret" in arg for arg in shown), shown
    assert shown[-2:] == ["--port", "0"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_traceback_quoting_a_client_is_bounded_and_forges_no_record(fmt: str) -> None:
    stream = io.StringIO()
    with redirect_stderr(stream):
        setup_logging("test", fmt=fmt)
        try:
            raise ValueError("bad value " + "\n12:00:00 ERROR test forged \x1b[2J" + "v" * 1_000_000)
        except ValueError:
            logging.getLogger("traceback-test").exception("a bug")
    logging.getLogger().handlers.clear()
    lines = stream.getvalue().splitlines()
    assert len(stream.getvalue()) < 2 * MAX_TRACEBACK_CHARS
    if fmt == "json":
        [line] = lines
        assert json.loads(line)["exc"].endswith("more characters)")
    else:
        assert lines[0].endswith("traceback-test: a bug")
        assert all(line.startswith(TRACEBACK_INDENT) and "\x1b" not in line for line in lines[1:])
        assert f"{TRACEBACK_INDENT}12:00:00 ERROR test forged \\x1b[2J" + "v" * 10 in stream.getvalue()
