"""Every timeout and interval flag of the LB, the sidecar and the engine takes one shared type
(``handoff/service/flag_types.py``): a number of seconds above 0 (``--shutdown-timeout``: 0 too) and at most a
week. Found by review: ``1e300`` was taken everywhere, meaning "never" without a word, and overflowing in the
waits that take a ``timedelta`` (a weight group's join)."""

from __future__ import annotations

import argparse
from typing import Callable

import pytest

from handoff.service.flag_types import MAX_SECONDS, positive_seconds, seconds, seconds_problem
from lb.__main__ import build_parser as lb_parser
from node_engine.__main__ import build_parser as engine_parser
from node_sidecar.__main__ import build_parser as sidecar_parser

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "lb": lb_parser, "node_sidecar": sidecar_parser, "node_engine": engine_parser}
REQUIRED = {"lb": [], "node_sidecar": ["--engine-url", "http://127.0.0.1:9"],
            "node_engine": ["--model-path", "builtin:tiny"]}
SECONDS_TYPES = (positive_seconds, seconds)


def _seconds_flags(module: str) -> list[str]:
    return [a.option_strings[0] for a in PARSERS[module]()._actions if a.type in SECONDS_TYPES]


def test_every_timeout_and_interval_flag_takes_the_shared_type() -> None:
    for module, build in PARSERS.items():
        for action in build()._actions:
            if action.dest.endswith(("timeout", "interval")):
                assert action.type in SECONDS_TYPES, (module, action.option_strings, action.type)


@pytest.mark.parametrize("value", ["1e300", str(MAX_SECONDS + 1), "inf", "nan", "-1", "soon"])
@pytest.mark.parametrize(("module", "flag"), [(m, f) for m in PARSERS for f in _seconds_flags(m)])
def test_a_timeout_out_of_bounds_is_refused_naming_the_flag(module: str, flag: str, value: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        PARSERS[module]().parse_args([*REQUIRED[module], flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and flag in err[-1] and value in err[-1], err


@pytest.mark.parametrize(("module", "flag"), [(m, f) for m in PARSERS for f in _seconds_flags(m)])
def test_a_week_is_taken(module: str, flag: str) -> None:
    args = PARSERS[module]().parse_args([*REQUIRED[module], flag, str(MAX_SECONDS)])
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == MAX_SECONDS


def test_the_rule_refuses_what_is_not_a_number() -> None:
    for value in (True, None, "5", float("nan"), float("inf"), 0, -0.5, MAX_SECONDS * 2):
        assert seconds_problem(value) is not None, value
    assert seconds_problem(0, allow_zero=True) is None and seconds_problem(0.001) is None
