"""A vLLM server (CPU) behind a sidecar and an LB: the SPEC's promises hold on a vLLM node.

On vLLM alone, ``/sleep`` with requests running aborts them (or waits) and a
request sent while asleep hangs until ``/wake_up``. Behind the sidecar:
release drains or aborts first (none lost), generation while released is a
503 with ``Retry-After`` at once, repeated calls are no-ops, after a level-2
sleep the node refuses generation until a reload, and SGLang-shaped
``/generate`` (logprobs included) works through the LB. vLLM on CPU frees no
memory on sleep; the figures measured (process RSS) are reported as such.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from handoff.cluster.vllm import VllmProcess
from handoff.protocol.control import NODE_STATE_HEADER
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.lb.lbproc import LB, node_args
from tests.support.procs import ServerProcess, wait_until
from tests.support.sse import iter_events
from tests.support.streams import GenerationClient

ALL = ["weights", "kv_cache", "cuda_graph", "workspace"]
# frequent checks, but a patient timeout: a generating vLLM worker holds one of CI's two cores, and a sidecar that
# answers a check in over a second there is busy, not down (the health logic is tested in tests/lb)
LB_HEALTH = ["--health-interval", "0.2", "--health-timeout", "5"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = [72, 101, 108, 108, 111]


class VllmNode:
    def __init__(self, vllm: VllmProcess, log_dir: Path) -> None:
        self.vllm = vllm
        self.log_dir = log_dir
        self.sidecar = self.start_sidecar()
        self.lb = LB(ServerProcess("lb", [*LB_HEALTH, *node_args(self.sidecar.url)], log_dir=log_dir,
                                   name="lb").start())
        self.lb.wait_routable([self.sidecar.url], timeout=60)

    def start_sidecar(self, port: int | None = None) -> ServerProcess:
        sidecar = ServerProcess("node_sidecar", ["--engine-url", self.vllm.url, "--engine-poll-interval", "0.2"],
                                log_dir=self.log_dir, name="sidecar").start(port=port)
        wait_until(lambda: httpx.get(sidecar.url + "/memory_occupation").json()["engine_kind"] == "vllm",
                   timeout=60, what="engine kind read")
        return sidecar

    def post(self, path: str, body: dict | None = None, *, via_lb: bool = False, **kwargs: Any) -> httpx.Response:
        base = self.lb.url if via_lb else self.sidecar.url
        return httpx.post(base + path, json={} if body is None else body, timeout=120, **kwargs)

    def occupation(self) -> dict:
        return httpx.get(self.sidecar.url + "/memory_occupation", timeout=30).json()

    def is_sleeping(self) -> bool:
        return httpx.get(self.vllm.url + "/is_sleeping", timeout=30).json()["is_sleeping"]

    def greedy(self, prompt: list[int] = PROMPT) -> list[int]:
        r = self.post("/generate", {"input_ids": prompt, "sampling_params": GREEDY}, via_lb=True)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    def wait_serving(self) -> None:
        wait_until(lambda: self.occupation()["serving"], timeout=60, what="serving")
        self.lb.wait_routable([self.sidecar.url], timeout=30)

    def freeze_vllm(self) -> None:
        """vLLM's own pause, mode keep: its scheduler stops, requests stay (running or arriving, queued) until
        :meth:`thaw_vllm`; the sidecar knows nothing of it. Its cache is kept: a pause that clears it preempts
        the running requests (their KV dropped, recomputed on the resume)."""
        frozen = httpx.post(self.vllm.url + "/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=30)
        assert frozen.status_code == 200, frozen.text

    def thaw_vllm(self) -> None:
        assert httpx.post(self.vllm.url + "/resume", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def node(checkpoints: tuple[Path, Path], proc_log_dir: Path):
    # without handoff's worker extension (tests/vllm/test_vllm_weight_sync.py has it): weight pushes are 400
    vllm = VllmProcess(str(checkpoints[0]), log_dir=proc_log_dir, weight_sync=False).start()
    node = VllmNode(vllm, proc_log_dir)
    version = node.post("/update_weights_from_disk", {"model_path": str(checkpoints[0]), "weight_version": "step-0"})
    assert version.status_code == 200, version.text
    yield node
    node.lb.close()
    node.sidecar.stop()
    rpc_dir = vllm.rpc_dir
    vllm.stop()
    assert rpc_dir is not None and not os.path.exists(rpc_dir), "vLLM's engine sockets were left behind"


def test_vllm_keeps_its_engine_sockets_in_a_folder_of_its_own(node: VllmNode) -> None:
    """vLLM's engine sockets go in a folder made for this process (removed when it stops: the module's fixture
    checks), not loose in the temporary folder, where a stopped server's were left behind."""
    rpc_dir = node.vllm.rpc_dir
    assert rpc_dir is not None and os.path.dirname(rpc_dir) == tempfile.gettempdir()
    entries = [os.path.join(rpc_dir, name) for name in os.listdir(rpc_dir)]
    assert entries and all(stat.S_ISSOCK(os.stat(path).st_mode) for path in entries), entries


@pytest.fixture
def serving(node: VllmNode, checkpoints: tuple[Path, Path]):
    """Each test starts and leaves the node serving step-0's weights."""
    yield node
    node.post("/resume_memory_occupation")
    if not node.occupation()["weights_valid"] or node.occupation()["weight_version"] != "step-0":
        node.post("/update_weights_from_disk", {"model_path": str(checkpoints[0]), "weight_version": "step-0"})
    node.wait_serving()


def start_mixed_load(node: VllmNode, max_tokens: int) -> list[GenerationClient]:
    """Through the LB: SGLang /generate (stream and not) and OpenAI completions (stream and not), all running
    together. The node is paused while they arrive (its sidecar holds them, as SGLang queues requests while
    paused) and continued once it holds all four: started one by one, a fast engine finished the first before
    the last arrived."""
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    completion = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    bodies = [("/generate", {**generate, "stream": True}), ("/generate", generate),
              ("/v1/completions", {**completion, "stream": True}), ("/v1/completions", completion)]
    clients = [GenerationClient(node.lb.url + path, body, timeout=300) for path, body in bodies]
    paused = node.post("/pause_generation", {"mode": "wait"})
    assert paused.status_code == 200, paused.text
    for c in clients:
        c.start()

    def all_held() -> bool:
        ended = [c for c in clients if not c.is_alive()]
        if ended:  # a request was refused rather than held: say how, rather than time out
            raise AssertionError(f"{ended[0].url} ended while the node was paused: {ended[0].result}")
        return node.occupation()["held"] == len(clients)

    wait_until(all_held, timeout=60, what="all requests held")
    continued = node.post("/continue_generation")
    assert continued.status_code == 200, continued.text
    # the state the answer carries is read as it starts, after the held requests entered: polling the view
    # instead could see a request end first (a busy CI box once never saw all four in 30 s)
    state = json.loads(continued.headers[NODE_STATE_HEADER])
    assert (state["in_flight"], state["held"]) == (len(clients), 0), state
    return clients


def test_release_wait_drains_every_request_then_sleeps(serving: VllmNode) -> None:
    """vLLM is frozen (its own pause) before the requests reach it and thawed once the release is draining: the
    drain certainly finds all four running. Sized to last seconds instead, they ended before the release went
    out on busy CI boxes (probes slowed by the box ran a warm vLLM's requests out in a fraction of that)."""
    node = serving
    node.freeze_vllm()
    with ThreadPoolExecutor(1) as pool:
        try:
            clients = start_mixed_load(node, 200)
            before = node.occupation()  # vLLM frozen: none can end
            assert before["in_flight"] == len(clients), before
            sent_at = time.monotonic()
            releasing = pool.submit(node.post, "/release_memory_occupation", {"mode": "wait", "drain_timeout": 90},
                                    via_lb=True)
            wait_until(lambda: releasing.done() or node.occupation()["admission"] != "open", timeout=60,
                       what="the release draining")
        finally:
            node.thaw_vllm()
        r = releasing.result(150)
    took_s = time.monotonic() - sent_at
    assert r.status_code == 200, r.text
    body = r.json()["results"][0]["body"]
    if not (body["released"] == ALL and body["drained_requests"] == 4 and body["aborted_requests"] == 0):
        pytest.fail(_account(node, f"before the release: in flight {before['in_flight']}, held {before['held']}; "
                                   f"it took {took_s:.2f} s and answered {body}", clients, sent_at))
    assert body["bytes_measured_by"] == "process_rss" and set(body["bytes_freed"]) == {"weights+kv_cache"}
    for c in clients:  # none lost: each ran to its end
        result = c.finish(120)
        assert result.status == 200 and result.error is None and result.finish_reason == "length"
        assert result.body is not None or result.saw_done
    assert node.is_sleeping()
    assert all(t["state"] == "released" for t in node.occupation()["tags"].values())


def _account(node: VllmNode, what: str, clients: list[GenerationClient], since: float) -> str:
    """A failure's whole story, untruncated: what happened, how each request ended (against ``since``), and the
    end of each process's log (vLLM's without its health checks)."""
    lines = [f"{what} (at {time.strftime('%H:%M:%S')}, the logs' clock)",
             *(f"{c.url} (stream {bool(c.body.get('stream'))}): {c.result.summary(since)}" for c in clients)]
    for proc in (node.sidecar, node.lb.proc, node.vllm):
        log = proc.log_path.read_text(errors="replace").splitlines() if proc.log_path.exists() else []
        lines += [f"--- {proc.log_path} ---", *[line for line in log if "GET /" not in line][-25:]]
    return "\n".join(lines)


def test_generation_while_released_is_503_at_once_never_the_hang(serving: VllmNode) -> None:
    node = serving
    assert node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert node.is_sleeping()  # vLLM itself would hold this request until a wake-up
    for path, body in (("/generate", {"input_ids": PROMPT}), ("/v1/completions", {"prompt": PROMPT})):
        started = time.monotonic()
        r = node.post(path, body)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "node_released"
        assert time.monotonic() - started < 5
        via_lb = node.post(path, body, via_lb=True)
        assert via_lb.status_code == 503 and via_lb.headers["retry-after"]
    health = httpx.get(node.sidecar.url + "/health_generate", timeout=30).json()
    # the workspace follows kv_cache (handoff's tag rule; vLLM has no region for it)
    assert health == {"serving": False, "reason": "node_released", "released": ["kv_cache", "workspace"]}
    assert node.occupation()["tags"]["weights"]["state"] == "resident"  # kv_cache alone: weights woken at once
    resumed = node.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).json()
    assert resumed["resumed"] == ["kv_cache", "workspace"] and resumed["serving"] is True and not node.is_sleeping()


def test_release_abort_ends_every_request_with_its_tokens(serving: VllmNode) -> None:
    """vLLM is frozen (its own pause) once the streams have their first tokens, and stays so through the release:
    the abort certainly finds all four running. vLLM takes the sidecar's aborts and its ``/sleep`` while frozen
    (the sleep's own pause replaces the freeze; the wake-up ends it). Sized to last seconds instead, the requests
    could end before the release went out on a busy CI box."""
    node = serving
    clients = start_mixed_load(node, 4000)
    released = False
    try:
        wait_until(lambda: all(c.started_streaming.is_set() for c in clients if c.body.get("stream")), timeout=60)
        node.freeze_vllm()
        running = node.occupation()  # vLLM frozen: none can end
        assert running["in_flight"] == len(clients), running
        r = node.post("/release_memory_occupation", {"mode": "abort"}, via_lb=True)
        released = r.status_code == 200
    finally:
        if not released:  # vLLM must not stay frozen for the next test (its /is_sleeping is true while paused too)
            node.thaw_vllm()
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["body"]["aborted_requests"] == 4
    for c in clients:
        result = c.finish(120)
        assert result.status == 200 and result.error is None and result.finish_reason == "abort", result
        if c.body.get("stream"):
            assert result.saw_done
    assert node.is_sleeping()


def test_repeated_release_and_resume_are_200_no_ops(serving: VllmNode) -> None:
    node = serving
    first = node.post("/release_memory_occupation", {"tags": ["weights"], "stage_to_cpu": True}).json()
    assert first["released"] == ["weights", "kv_cache"]  # vLLM sleeps its weights with the KV cache
    again = node.post("/release_memory_occupation", {"tags": ["weights"]})
    assert again.status_code == 200 and again.json()["released"] == []
    assert again.json()["already_released"] == ["weights"]
    # naming kv_cache brings the workspace with it (handoff's tag rule; nothing to free in vLLM)
    named = node.post("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}).json()
    assert named["released"] == ["workspace"] and named["already_released"] == ["weights", "kv_cache"]
    rest = node.post("/release_memory_occupation").json()
    assert rest["released"] == ["cuda_graph"] and rest["bytes_freed"] == {}
    assert node.post("/resume_memory_occupation", {"tags": ["weights"]}).json()["resumed"] == ["weights"]
    assert node.is_sleeping()  # the KV cache still sleeps
    assert node.post("/resume_memory_occupation", {"tags": ["weights"]}).json()["already_resident"] == ["weights"]
    done = node.post("/resume_memory_occupation").json()
    assert done["resumed"] == ["kv_cache", "cuda_graph", "workspace"] and done["weights_valid"] is True
    assert node.post("/resume_memory_occupation").json()["already_resident"] == ALL
    assert not node.is_sleeping() and node.occupation()["serving"] is True


def test_level_2_refuses_generation_until_a_reload(serving: VllmNode, checkpoints: tuple[Path, Path]) -> None:
    node = serving
    before = node.greedy()
    assert node.post("/release_memory_occupation", {"stage_to_cpu": False}).status_code == 200
    resumed = node.post("/resume_memory_occupation").json()
    assert resumed["weights_valid"] is False and resumed["serving"] is False
    r = node.post("/generate", {"input_ids": PROMPT})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weights_not_loaded"
    reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoints[1]), "weight_version": "step-1"},
                       via_lb=True)
    assert reload.status_code == 200, reload.text
    assert node.occupation()["weight_version"] == "step-1" and node.occupation()["serving"] is True
    after = node.greedy()
    assert after != before  # step-1's weights serve
    meta = node.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()["meta_info"]
    assert meta["weight_version"] == "step-1"


def test_reload_while_released_wakes_the_weights_and_bad_checkpoints_are_400(serving: VllmNode, tmp_path: Path,
                                                                              checkpoints: tuple[Path, Path]) -> None:
    node = serving
    before = node.greedy()
    missing = node.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and node.occupation()["serving"] is True
    arch = builtin_arch("builtin:tiny", {"num_layers": 2})  # another shape: vLLM would lose its weights half way
    save_checkpoint(tmp_path / "shallow", arch, builtin_weights(arch, 0))
    shallow = node.post("/update_weights_from_disk", {"model_path": str(tmp_path / "shallow")})
    assert shallow.status_code == 400 and "num_hidden_layers" in shallow.json()["error"]["message"]
    assert node.greedy() == before  # vLLM still serves, untouched
    assert node.post("/release_memory_occupation", {"stage_to_cpu": False}).status_code == 200
    reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoints[0]), "weight_version": "step-0"})
    assert reload.status_code == 200 and reload.json()["resumed"] == ["weights"]
    assert node.occupation()["tags"]["weights"]["state"] == "resident"
    assert node.post("/resume_memory_occupation").json()["serving"] is True
    node.wait_serving()  # the LB learns of a call made to the sidecar directly on its next health check
    assert node.greedy() == before


def test_sglang_generate_through_the_lb_with_logprobs(serving: VllmNode) -> None:
    node = serving
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "rid": "req-1"}
    r = node.post("/generate", body, via_lb=True)
    assert r.status_code == 200, r.text
    answer = r.json()
    meta = answer["meta_info"]
    assert meta["id"] == "req-1" and meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8 == len(answer["output_ids"])
    assert meta["weight_version"] == "step-0" and isinstance(meta["e2e_latency"], float)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == answer["output_ids"]
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 2 and top[0][1] == token and top[0][0] == pytest.approx(lp)  # greedy: the top token
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT
    assert all(isinstance(lp, float) and lp < 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    assert meta["input_top_logprobs"][0] is None and all(len(row) == 2 for row in meta["input_top_logprobs"][1:])
    # a stream carries the whole answer so far in every event; its last equals the non-stream answer
    with httpx.Client(timeout=120) as client, client.stream("POST", node.lb.url + "/generate",
                                                            json={**body, "stream": True, "rid": None,
                                                                  "logprob_start_len": -1}) as s:
        events = [json.loads(e) for e in iter_events(s) if e != "[DONE]"]
    lengths = [len(e["output_ids"]) for e in events]  # vLLM may put several tokens in one chunk
    assert lengths == sorted(set(lengths)) and lengths[-1] == 8 and events[-1]["meta_info"]["finish_reason"]
    assert events[-1]["output_ids"] == answer["output_ids"] and events[-1]["text"] == answer["text"]
    assert [t for _, t, _ in events[-1]["meta_info"]["output_token_logprobs"]] == answer["output_ids"]
    # a batch is a list, in order; text prompts work too
    batch = node.post("/generate", {"text": ["Hello", "RL is"], "sampling_params": GREEDY}, via_lb=True).json()
    assert isinstance(batch, list) and [len(a["output_ids"]) for a in batch] == [8, 8]
    # OpenAI clients are passed through unchanged
    completion = node.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True, "return_token_ids": True}, via_lb=True).json()
    assert completion["choices"][0]["token_ids"] == answer["output_ids"]


def test_sglangs_null_and_zero_max_new_tokens_on_real_vllm(serving: VllmNode) -> None:
    """SGLang's ``max_new_tokens: null`` runs to the end of the context (the sidecar asks vLLM for its
    ``max_model_len``, read from its ``/server_info``, and vLLM caps it at what the prompt leaves); ``0`` scores the
    prompt and generates nothing (vLLM's least is 1 token, which the answer drops)."""
    node = serving
    room = 40
    prompt = [65] * (builtin_arch("builtin:tiny", {}).max_position_embeddings - room)
    whole = node.post("/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "ignore_eos": True, "max_new_tokens": None}}, via_lb=True)
    assert whole.status_code == 200, whole.text
    assert len(whole.json()["output_ids"]) == room, whole.json()["meta_info"]
    scored = node.post("/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                     "sampling_params": {"max_new_tokens": 0}}, via_lb=True)
    assert scored.status_code == 200, scored.text
    answer = scored.json()
    assert answer["output_ids"] == [] and answer["text"] == "" and answer["meta_info"]["output_token_logprobs"] == []
    assert [t for _, t, _ in answer["meta_info"]["input_token_logprobs"]] == PROMPT


def test_logprobs_vllm_would_answer_from_another_distribution_are_refused(serving: VllmNode) -> None:
    """vLLM's default ``--logprobs-mode raw_logprobs`` answers logprobs before the temperature: at 0.7 they would
    not be SGLang's (tempered), so the request is a 400 naming the mode, and nothing runs; at 1 it is served."""
    node = serving
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    refused = node.post("/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 0.7}},
                        via_lb=True)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "unsupported", refused.text
    assert "--logprobs-mode" in refused.json()["error"]["message"]
    served = node.post("/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 1.0,
                                                                  "sampling_seed": 5}}, via_lb=True)
    assert served.status_code == 200, served.text
    assert len(served.json()["meta_info"]["output_token_logprobs"]) == 4


def test_sglang_n_samples_through_the_lb(serving: VllmNode) -> None:
    """sampling_params.n on a vLLM node as on SGLang: a list of prompts x n answers, prompt by prompt; greedy n
    gives n equal answers (vLLM alone refuses n > 1 at temperature 0), seeded sampling is reproducible."""
    node = serving
    expected = node.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}, via_lb=True).json()
    greedy = node.post("/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 3}}, via_lb=True)
    assert greedy.status_code == 200, greedy.text
    assert [a["output_ids"] for a in greedy.json()] == [expected["output_ids"]] * 3
    sampled_body = {"input_ids": [PROMPT, [1, 2, 3, 4]], "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 4, "sampling_seed": 11}}
    sampled = node.post("/generate", sampled_body, via_lb=True)
    assert sampled.status_code == 200, sampled.text
    answers = sampled.json()
    assert len(answers) == 8 and all(len(a["output_ids"]) == 8 for a in answers)
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [5] * 4 + [4] * 4  # prompt-major, as SGLang
    assert len({tuple(a["output_ids"]) for a in answers[:4]}) > 1  # n independent samples, not one copied
    again = node.post("/generate", sampled_body, via_lb=True).json()
    assert [a["output_ids"] for a in again] == [a["output_ids"] for a in answers]


def test_what_vllm_cannot_do_is_400_and_abort_by_rid_works(serving: VllmNode) -> None:
    node = serving
    r = node.post("/generate", {"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported"
    assert "json_schema" in r.json()["error"]["message"]
    assert node.post("/generate", {"input_ids": PROMPT, "lora_path": "x"}).json()["error"]["type"] == "unsupported"
    # a top-level key SGLang's contract does not know is ignored, as there; one in sampling_params is a 400
    assert node.post("/generate", {"input_ids": PROMPT, "nonsense": 1,
                                   "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    assert node.post("/generate", {"input_ids": PROMPT, "sampling_params": {"nonsense": 1}}).status_code == 400
    tensor = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert tensor.status_code == 400 and tensor.json()["error"]["type"] == "unsupported"
    assert "--worker-extension-cls node_sidecar.engines.vllm_worker_ext.HandoffWeightSync" in tensor.text
    group = node.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29999,
                                                     "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    assert group.status_code == 400 and group.json()["error"]["type"] == "unsupported"
    retract = node.post("/pause_generation", {"mode": "retract"})
    assert retract.status_code == 400 and retract.json()["error"]["type"] == "unsupported"
    assert node.occupation()["serving"] is True  # a refused pause leaves the node serving
    assert node.post("/update_weight_version", {"new_version": "renamed"}).json()["new_version"] == "renamed"
    assert httpx.get(node.sidecar.url + "/get_weight_version").json() == {"weight_version": "renamed"}
    assert httpx.get(node.vllm.url + "/weight_info").json() == {"weight_version": "renamed"}
    assert httpx.get(node.sidecar.url + "/model_info").json()["weight_version"] == "renamed"
    assert node.post("/update_weight_version", {"new_version": "step-0"}).status_code == 200
    # events 50 tokens apart: each repeats the whole answer so far, and 3000 one-token events took the sidecar
    # longer to translate than vLLM took to generate them. vLLM is frozen (its own pause, mode keep) once the
    # request streams: on two busy cores the abort call took seconds and came after vLLM's last token
    long = GenerationClient(node.sidecar.url + "/generate", {"input_ids": PROMPT, "rid": "to-abort", "stream": True,
                                                             "sampling_params": {"max_new_tokens": 3000,
                                                                                 "ignore_eos": True,
                                                                                 "stream_interval": 50}},
                            timeout=120)
    long.start()
    assert long.started_streaming.wait(60)
    node.freeze_vllm()
    try:
        assert node.post("/abort_request", {"rid": "to-abort"}).status_code == 200
        result = long.finish(60)
    finally:
        node.thaw_vllm()
    assert result.saw_done and result.events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result.events[-1]["output_ids"]) < 3000


def test_a_flush_with_a_request_running_preempts_it_and_loses_nothing(serving: VllmNode) -> None:
    """vLLM resets its prefix cache only when no running request holds blocks: the sidecar asked again until an
    idle moment, which never came under steady load (a fresh-clone CI run's flush answered 503 after its whole
    deadline). A refused reset is sent again preempting the running requests: the flush answers at once and the
    running request ends with the same tokens. vLLM is frozen (its own pause, mode keep, its cache kept) while
    the flush is sent, so the request certainly holds blocks then."""
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 1500,
                                                                     "stream_interval": 50}}
    reference = node_stream(serving, body)
    running = GenerationClient(serving.sidecar.url + "/generate", body, timeout=120)
    running.start()
    assert running.started_streaming.wait(60)
    serving.freeze_vllm()  # its cache kept: a pause that clears it preempts the request
    try:
        refused = httpx.post(serving.vllm.url + "/reset_prefix_cache", timeout=30).json()
        flushed = serving.post("/flush_cache")
    finally:
        serving.thaw_vllm()
    assert refused == {"success": False}  # vLLM alone: the running request's blocks keep the cache
    assert flushed.status_code == 200 and flushed.json()["message"].startswith("Cache flushed."), flushed.text
    result = running.finish(60)
    assert result.saw_done and result.events[-1]["output_ids"] == reference


def node_stream(node: VllmNode, body: dict[str, Any]) -> list[int]:
    """The output ids of one streamed request to the sidecar, run to its end."""
    client = GenerationClient(node.sidecar.url + "/generate", body, timeout=120)
    client.start()
    result = client.finish(60)
    assert result.saw_done, result
    return result.events[-1]["output_ids"]


def test_a_new_sidecar_reads_a_sleeping_vllm_as_released(serving: VllmNode, checkpoints: tuple[Path, Path]) -> None:
    node = serving
    assert node.post("/release_memory_occupation", {"stage_to_cpu": True}).status_code == 200
    port = node.sidecar.port
    node.sidecar.stop()
    node.sidecar = node.start_sidecar(port=port)  # knows nothing of the release: reads /is_sleeping
    view = node.occupation()
    assert all(t["state"] == "released" for t in view["tags"].values())
    resumed = node.post("/resume_memory_occupation").json()
    assert resumed["weights_valid"] is False and resumed["serving"] is False  # the sleep level is unknown: the
    # weights count as discarded (level 2), so the node waits for a reload rather than risk serving garbage
    assert node.post("/update_weights_from_disk", {"model_path": str(checkpoints[0]),
                                                   "weight_version": "step-0"}).status_code == 200
    node.wait_serving()


def test_a_restarted_vllm_is_read_again_as_a_fresh_engine(serving: VllmNode, checkpoints: tuple[Path, Path]) -> None:
    """vLLM killed while asleep at level 2 and started again (same port): the sidecar sees a new instance_id, puts
    the fresh vLLM to sleep again (the cluster had released the node), and, since the node's weights came from a
    reload (step-0), does not serve vLLM's start weights (weights_stale) until the next reload."""
    node = serving
    assert node.post("/release_memory_occupation", {"stage_to_cpu": False}).status_code == 200
    node.vllm.kill()
    wait_until(lambda: node.occupation()["engine_reachable"] is False, timeout=30, what="the engine seen down")
    r = node.post("/generate", {"input_ids": PROMPT})
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    node.vllm.start()
    wait_until(lambda: node.occupation()["engine_reachable"] and all(
        t["state"] == "released" for t in node.occupation()["tags"].values()), timeout=120, what="asleep again")
    assert node.occupation()["not_serving_reason"] == "node_released"
    assert node.post("/resume_memory_occupation").status_code == 200
    assert node.occupation()["not_serving_reason"] == "weights_stale"
    assert node.post("/update_weights_from_disk", {"model_path": str(checkpoints[0]),
                                                   "weight_version": "step-0"}).status_code == 200
