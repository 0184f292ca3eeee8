"""A short soak (issue 8): load through the LB during release/resume cycles of every kind; nothing is lost.

The same code as ``bench/soak.py`` (100 cycles, 16 clients) with 10 cycles and 8
clients, so it stays well under a minute on a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.soak import (
    SoakConfig,
    classify_answer,
    classify_stream,
    run_soak,
)

pytestmark = pytest.mark.timeout(120)


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    config = SoakConfig(num_cycles=10, num_clients=8, idle_cycles=10)
    report = run_soak(config, tmp_path)
    # every process: RSS within 5% of after the first cycle, fds flat; and the engines' RSS over cycles
    # run after the load stopped within 2% (a leaked weights copy, 3 MiB per cycle, would show there)
    problems = report.problems()
    assert not problems, "\n".join(problems) + "\n" + report.table()
    assert report.counts["lost"] == 0 and report.num_requests == sum(report.counts.values())
    assert report.counts["completed"] > 0 and report.counts["aborted"] > 0 and report.counts["refused"] > 0
    assert set(report.refusal_types) <= {"no_available_node", "node_released", "weights_not_loaded"}
    assert report.aborted_by_release > 0 and report.drained_requests > 0
    assert len(report.release_s) == 10 and len(report.reload_s) == 4
    assert set(report.samples) == {"lb", "node0-sidecar", "node1-sidecar", "node0-engine", "node1-engine"}
    assert set(report.idle_engine_rss) == {"node0-engine", "node1-engine"}


def test_the_classification_catches_every_kind_of_loss() -> None:
    """The soak's verdicts are only as good as its classifier: each way to lose a request is called lost."""
    import httpx

    ok = b'{"text": "ab", "output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"}, ' \
         b'"completion_tokens": 2, "weight_version": "v"}}'
    assert classify_answer(200, httpx.Headers(), ok, 2).outcome == "completed"
    aborted = ok.replace(b'"length"', b'"abort"')
    assert classify_answer(200, httpx.Headers(), ok.replace(b'{"type": "length"}', b'"length"'), 2).outcome == "lost"
    assert classify_answer(200, httpx.Headers(), aborted, 5).outcome == "aborted"
    refused = b'{"error": {"type": "no_available_node", "message": "m"}}'
    assert classify_answer(503, httpx.Headers({"Retry-After": "1"}), refused, 2).outcome == "refused"
    lost_answers = [
        (503, httpx.Headers(), refused),                                   # no Retry-After
        (503, httpx.Headers({"Retry-After": "1"}), b"Service Unavailable"),  # not the envelope
        (502, httpx.Headers(), b'{"error": {"type": "upstream_error", "message": "m"}}'),
        (500, httpx.Headers(), b"{}"),
        (200, httpx.Headers(), b'{"text": "ab", "output_ids": [1, 2]'),     # malformed JSON
        (200, httpx.Headers(), ok.replace(b"[1, 2]", b'["1", 2]')),         # wrong types
        (200, httpx.Headers(), ok.replace(b'"completion_tokens": 2', b'"completion_tokens": 3')),
        (200, httpx.Headers(), ok),                                        # fewer tokens than asked, "length"
    ]
    for status, headers, body in lost_answers[:-1]:
        assert classify_answer(status, headers, body, 2).outcome == "lost", body
    assert classify_answer(200, httpx.Headers(), lost_answers[-1][2], 3).outcome == "lost"
    event = '{"text": "a", "output_ids": [1], "meta_info": {"finish_reason": null, "completion_tokens": 1, ' \
            '"weight_version": "v"}}'
    last = event.replace("null", '{"type": "length"}').replace('"completion_tokens": 1', '"completion_tokens": 2') \
        .replace("[1]", "[1, 2]")
    assert classify_stream([event, last], True, "", 2).outcome == "completed"
    assert classify_stream([event, last.replace("[1, 2]", "[3, 2]")], True, "", 2).outcome == "lost"
    assert classify_stream([event, last], False, "", 2).outcome == "lost"          # no [DONE]
    assert classify_stream([event], True, 'data: {"te', 2).outcome == "lost"        # cut inside an event
    error = '{"error": {"type": "upstream_error", "message": "m"}}'
    assert classify_stream([event, error], True, "", 2).outcome == "lost"          # an error event
    assert classify_stream([event, "not json"], True, "", 2).outcome == "lost"
