"""Failed steps and a dying engine, on real engine and sidecar processes (issues 13 and 18).

The engine runs with ``--fault-drill-file``: the test writes a one-shot fault and the next matching step (or
control call) fails as a device would. A step that raises fails its requests with ``engine_failed`` while
the others complete; a call queued behind it is answered; an error that leaves the device unusable ends the
process with code 3 after answering everything, and the sidecar reports ``engine_unavailable`` until a
supervisor (here, the test) restarts it. An engine that dies during a control call is reported as exactly
that.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from node_engine.failures import EXIT_ENGINE_FAILED
from tests.support.procs import ServerProcess, wait_until
from tests.support.sse import iter_events

pytestmark = pytest.mark.timeout(120)

LONG = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
SHORT = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


class Node:
    """One sidecar in front of one engine on a fixed port, restarted by the test as a supervisor would."""

    def __init__(self, log_dir: Path) -> None:
        self.drill = log_dir / "fault.json"
        self.engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver",
                                                    "--fault-drill-file", str(self.drill)],
                                    log_dir=log_dir, name="faulty-engine").start()
        self.sidecar = ServerProcess("node_sidecar", ["--engine-url", self.engine.url, "--engine-poll-interval",
                                                      "0.2"], log_dir=log_dir, name="faulty-sidecar").start()
        self.client = httpx.Client(base_url=self.sidecar.url, timeout=60)

    def ready(self) -> None:
        if not self.engine.is_running():
            self.engine.start()  # on its previous port: the sidecar finds it again
        wait_until(lambda: self.client.get("/ready").status_code == 200, timeout=30, what="the node serving")

    def arm(self, kind: str, at: str, delay_s: float = 0.0) -> None:
        self.drill.with_name(self.drill.name + ".fired").unlink(missing_ok=True)
        tmp = self.drill.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kind": kind, "at": at, "delay_s": delay_s}))
        tmp.replace(self.drill)

    def wait_fired(self) -> None:
        wait_until(self.drill.with_name(self.drill.name + ".fired").exists, timeout=30, what="the fault to fire")

    def close(self) -> None:
        self.client.close()
        self.sidecar.stop()
        self.engine.stop()


@pytest.fixture(scope="module")
def node(proc_log_dir: Path) -> Iterator[Node]:
    node = Node(proc_log_dir)
    yield node
    node.close()


def fail_a_step_with_a_call_queued(node: Node, kind: str) -> tuple[httpx.Response, httpx.Response]:
    """A request whose decode step fails with ``kind`` after 1 s, and a control call sent meanwhile (it waits in
    the engine's inbox behind the step): their answers."""
    node.arm(kind, "decode", delay_s=1.0)
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(
        node.client.post("/generate", json={"text": "x", "sampling_params": LONG})))
    thread.start()
    node.wait_fired()
    flushed = node.client.post("/flush_cache")
    thread.join(60)
    return answers[0], flushed


def test_a_failed_step_fails_its_request_and_the_others_complete(node: Node) -> None:
    node.ready()
    with node.client.stream("POST", "/generate", json={"text": "a long answer", "stream": True,
                                                       "sampling_params": LONG}) as running:
        assert running.status_code == 200
        events = iter_events(running)
        next(events)  # prefilled: decoding from now on
        node.arm("oom", "prefill")
        failed = node.client.post("/generate", json={"text": "another prompt", "sampling_params": SHORT})
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["type"] == "engine_failed" and "OutOfMemoryError" in error["message"]
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]
    assert node.client.post("/generate", json={"text": "after", "sampling_params": SHORT}).status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "streamed", "sampling_params": SHORT}),
    ("/v1/completions", {"prompt": "streamed", "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "streamed"}], "max_tokens": 4,
                              "temperature": 0, "ignore_eos": True}),
])
def test_a_stream_whose_step_fails_ends_with_an_error_event_then_done(node: Node, path: str, body: dict) -> None:
    """As SGLang's stream generators end a failed stream (``http_server.py`` ``stream_results``,
    ``serving_chat.py`` and ``serving_completions.py``: the ``except`` branch falls through to ``[DONE]``)."""
    node.ready()
    node.arm("error", "decode")
    with node.client.stream("POST", path, json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        payloads = list(iter_events(streamed))
    assert payloads[-1] == "[DONE]" and json.loads(payloads[-2])["error"]["type"] == "engine_failed"
    assert "[DONE]" not in payloads[:-1]
    if path == "/v1/chat/completions":  # the OpenAI client raises at the error event
        node.arm("error", "decode")
        with openai.OpenAI(base_url=node.sidecar.url + "/v1", api_key="unused", timeout=60, max_retries=0) as sdk:
            with pytest.raises(openai.APIError, match="engine_failed|step"):
                list(sdk.chat.completions.create(model="builtin:tiny", stream=True, messages=body["messages"],
                                                 max_tokens=4, extra_body={"ignore_eos": True}))
    assert node.client.post("/generate", json={"text": "after", "sampling_params": SHORT}).status_code == 200


def test_a_control_call_queued_behind_a_failing_step_is_answered(node: Node) -> None:
    node.ready()
    failed, flushed = fail_a_step_with_a_call_queued(node, "oom")
    assert flushed.status_code == 200, flushed.text
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "engine_failed"
    assert node.engine.is_running()


def test_a_device_error_answers_everything_and_ends_the_engine(node: Node) -> None:
    node.ready()
    started = time.monotonic()
    failed, flushed = fail_a_step_with_a_call_queued(node, "fatal")
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "engine_failed"
    assert flushed.status_code == 503 and flushed.json()["error"]["type"] == "engine_stopped", flushed.text
    assert time.monotonic() - started < 30  # answered, not left to the sidecar's control timeout
    wait_until(lambda: not node.engine.is_running(), timeout=30, what="the engine to exit")
    assert node.engine.returncode == EXIT_ENGINE_FAILED
    refused = wait_until(lambda: (r := node.client.post("/generate", json={"text": "x"})).status_code == 503 and r,
                         timeout=30, what="the sidecar to refuse")
    assert refused.json()["error"]["type"] == "engine_unavailable"
    node.ready()  # restarted, the node serves again
    assert node.client.post("/generate", json={"text": "x", "sampling_params": SHORT}).status_code == 200


def test_an_engine_dying_during_a_control_call_is_reported_as_such(node: Node) -> None:
    """torch_memory_saver exits the process on a failed resume or backup write; the sidecar says so."""
    node.ready()
    node.arm("exit", "release")
    started = time.monotonic()
    answer = node.client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert time.monotonic() - started < 30
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "engine_unavailable"
    assert error["call"] == "POST /release_memory_occupation" and error.get("engine_died") is True, error
    assert "died during POST /release_memory_occupation" in error["message"]
    wait_until(lambda: not node.engine.is_running(), timeout=30, what="the engine to exit")
    assert node.engine.returncode == 1
    node.ready()  # its state is read again from the restarted engine
    view = node.client.get("/memory_occupation").json()
    assert all(t["state"] == "resident" for t in view["tags"].values())
