"""Schemathesis (issue 8) against the schemas the LB and a sidecar serve, bounded.

Every operation of ``/openapi.json`` is run with schema-made cases (valid and
invalid) and checked for: no 5xx (but the LB's documented 503 ``no_nodes`` for a
``?role=`` with no member), responses in a documented content type, and JSON
that matches a documented schema. Left out, because changing state is their
job and the hypothesis fuzzing (``test_fuzz.py``) covers them with state checks:
on the sidecar the memory, reload, pause and weight calls (a valid group join
waits for a trainer); on the LB a release or pause (the fake nodes then stop
serving, and generation is a documented 503), ``POST /nodes`` and the worker
registration routes (the LB would then check whatever URL was generated). The LB
runs in front of fake nodes that accept every control call, so that a 5xx can
only be the LB's own; the sidecar runs in front of a real ``builtin:tiny`` engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, node_args
from tests.support.procs import ServerProcess

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (the test extra has it)")

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 4
EXAMPLES_PER_OPERATION = 12


def clamp_generation(case: Any) -> Any:
    """Schema-valid generation bodies may ask for thousands of tokens: cap them, the shape is what is tested."""
    body = case.body
    if isinstance(body, dict):
        params = body.get("sampling_params")
        if isinstance(params, dict) and isinstance(params.get("max_new_tokens"), int):
            params["max_new_tokens"] = min(params["max_new_tokens"], MAX_TOKENS)
        elif isinstance(body.get("text"), (str, list)) or isinstance(body.get("input_ids"), list):
            body["sampling_params"] = {**(params if isinstance(params, dict) else {}), "max_new_tokens": MAX_TOKENS}
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) or (key == "max_tokens" and ("prompt" in body or "messages" in body)):
                body[key] = min(body[key], MAX_TOKENS) if isinstance(body.get(key), int) else MAX_TOKENS
    return case


def documented_5xx(case: Any, status: int, body: bytes) -> bool:
    """The 5xx an input may cause by itself, as documented: the LB's 503 ``no_nodes`` for a ``?role=``
    without members, and its 502 when every node missed the ``?timeout=`` the caller asked for (schemathesis
    asks for 1e-287 s)."""
    query = case.query or {}
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    if status == 503 and "role" in query:
        return isinstance(answer, dict) and answer.get("error", {}).get("type") == "no_nodes"
    if status == 502 and "timeout" in query and isinstance(answer, dict):
        failures = answer.get("failures") or []
        return bool(failures) and all(f.get("reason") == "timeout" for f in failures)
    return False


def run_schemathesis(base_url: str, exclude_path_regex: str,
                     exclude_name: str | None = None) -> tuple[list[str], list[str]]:
    """(operations run, failures as text); ``exclude_name`` is one operation as ``"METHOD /path"``."""
    from schemathesis.checks import content_type_conformance, response_schema_conformance

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json").exclude(path_regex=exclude_path_regex)
    if exclude_name is not None:
        schema = schema.exclude(name=exclude_name)
    ran: list[str] = []
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        ran.append(label)

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy().map(clamp_generation))
        def check(case: Any) -> None:
            response = case.call(base_url=base_url, timeout=30)
            assert response.status_code < 500 or documented_5xx(case, response.status_code, response.content), (
                f"{response.status_code} {response.content[:300]!r} for {case.as_curl_command()}")
            case.validate_response(response, checks=[content_type_conformance, response_schema_conformance])

        try:
            check()
        except Exception as exc:  # a failure group: reported with the operation, all operations still run
            failures.append(f"{label}: {exc}"[:2000])
    return ran, failures


@pytest.fixture(scope="module")
def sidecar(proc_log_dir: Path) -> Iterator[ServerProcess]:
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver"],
                           log_dir=proc_log_dir, name="st-engine").start(timeout=60)
    try:
        proc = ServerProcess("node_sidecar", ["--engine-url", engine.url], log_dir=proc_log_dir,
                             name="st-sidecar").start(timeout=60)
        yield proc
        proc.stop()
    finally:
        engine.stop()


def test_schemathesis_on_a_sidecar(sidecar: ServerProcess) -> None:
    ran, failures = run_schemathesis(
        sidecar.url, r"^/(release|resume|update_weights|pause|continue|init_weights|destroy_weights|begin_weight"
                     r"|end_weight|update_weight_version)")
    assert len(ran) >= 12 and "POST /generate" in ran and "POST /abort_request" in ran
    assert not failures, "\n\n".join(failures)


@pytest.fixture
def lb_over_fakes(proc_log_dir: Path) -> Iterator[Callable[[], LB]]:
    with FakeCluster() as fakes:
        nodes = fakes.start(2)
        proc = ServerProcess("lb", [*node_args(*(n.url for n in nodes)), "--health-interval", "0.2"],
                             log_dir=proc_log_dir, name="st-lb")
        lb = LB(proc.start(timeout=30))
        try:
            yield lambda: lb
        finally:
            lb.close()


def test_schemathesis_on_the_lb(lb_over_fakes: Callable[[], LB]) -> None:
    lb = lb_over_fakes()
    ran, failures = run_schemathesis(
        lb.url, r"^/(release_memory_occupation|pause_generation|add_worker|remove_worker|workers.*)$", "POST /nodes")
    assert len(ran) >= 10 and "POST /generate" in ran and "POST /resume_memory_occupation" in ran
    assert "DELETE /nodes" in ran and "POST /nodes" not in ran
    assert not failures, "\n\n".join(failures)
    assert all(n["routable"] for n in lb.nodes())
