"""A model-based test of one node's memory lifecycle: a real sidecar in front of a real engine (``builtin:tiny``).

Hypothesis drives the node over HTTP with random sequences of releases and
resumes (tag subsets, ``[]``, null, duplicates, an unknown tag,
``weights_drafter``; ``mode``, ``drain_timeout``, ``stage_to_cpu``), pauses
(``abort``, ``retract``, ``in_place``, ``wait``) and continues, cache flushes,
reloads (the same checkpoint, and a bad path), version updates, aborts and short
greedy generations, some left running across the control calls. A small model
(:class:`NodeModel`) says what SPEC sections 2, 3 and 9, docs/api.md and SGLang
0.5.23 make each call answer, and the node's answers and its
``/memory_occupation`` are checked against it after every step. Invariants:

- no 500, ever; every refusal is the error envelope with the status its type has;
- a generation that succeeds is the greedy output of the fresh node for its
  prompt (never from released or invalid weights, never from KV resumed without
  its contents); one aborted is a prefix of it; it names a version that was served
  while it ran;
- a request held while paused answers only after the continue;
- after each example the node is reset through the API (full resume, reload,
  continue) and nothing is left in flight or held.

Where timing decides (a generation that may or may not still be running when a
pause or a drain comes), the model accepts each answer the timing allows and
learns from the one given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.support.procs import ServerProcess, wait_until
from tests.support.streams import GenerationClient
from tests.support.weights import save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(300)

ALL = ("weights", "kv_cache", "cuda_graph", "workspace")
DRAFTER = "weights_drafter"
PROMPTS = ("Alpha probe", "Beta, longer probe", "Gamma")  # distinct first bytes: no shared cached prefix
REF_TOKENS = 400
DRAIN_S = 5.0  # the sidecar's default drain bound: a drain that cannot end costs this
STATUS_OF = {"invalid_request": 400, "requests_in_flight": 409, "drain_timeout": 409, "no_weights_backup": 409,
             "node_released": 503, "weights_not_loaded": 503}
# null (all), or a list: [] (none), subsets, duplicates, SGLang's drafter tag
TAGS = st.one_of(st.none(), st.lists(st.sampled_from((*ALL, DRAFTER)), max_size=5))
# a release body broken in one field (a 400, nothing changed), now and then
FAULTS = st.sampled_from([None] * 24 + [{"tags": ["vram"]}, {"tags": ["weights", "Weights"]}, {"tags": "weights"},
                                       {"mode": "later"}, {"drain_timeout": -1}, {"stage_to_cpu": "yes"}])
Outcome = tuple[int, "str | None"]  # (status, error type); None for a 2xx
OK: Outcome = (200, None)


@dataclass
class Node:
    url: str
    backup: str
    checkpoint: str
    reference: dict[int, list[int]]  # prompt -> the fresh node's greedy ids (REF_TOKENS of them)


@pytest.fixture(scope="module", params=["disk", "none"])
def node(request: pytest.FixtureRequest, proc_log_dir: Path) -> Iterator[Node]:
    """One engine and its sidecar per weights backup; the reference outputs are read while they are fresh."""
    backup = request.param
    folder = [] if backup == "none" else ["--backup-dir", str(proc_log_dir / backup)]
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver",
                                           "--weights-backup", backup, *folder],
                           log_dir=proc_log_dir, name=f"engine-{backup}")
    engine.start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                             "--drain-timeout", str(DRAIN_S)],
                            log_dir=proc_log_dir, name=f"sidecar-{backup}")
    try:
        sidecar.start()
        wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=10, what="sidecar ready")
        checkpoint = save_tiny(proc_log_dir / f"ckpt-{backup}", tiny_weights(0))  # the weights it started with
        # one batch (a third of the decode steps): the machine holds a batch to the same ids at every step
        r = httpx.post(sidecar.url + "/generate", json=generate_body(list(PROMPTS), REF_TOKENS), timeout=60)
        assert r.status_code == 200, r.text
        reference = {i: answer["output_ids"] for i, answer in enumerate(r.json())}
        yield Node(sidecar.url, backup, str(checkpoint), reference)
    finally:
        sidecar.stop()
        engine.stop()


def generate_body(prompt: str | list[str], max_new_tokens: int, rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"text": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                                "max_new_tokens": max_new_tokens}}
    if rid is not None:
        body["rid"] = rid
    return body


def canonical(names: set[str]) -> list[str]:
    return [t for t in ALL if t in names]


def asked_tags(tags: Any) -> tuple[list[str], bool] | None:
    """What a body's ``tags`` asks for as the node reads it (SPEC 9: null all, ``[]`` none, ``workspace``
    follows ``kv_cache``, ``weights_drafter`` not present here): (tags, drafter named), or None for a 400."""
    if tags is None:
        return list(ALL), False
    if not isinstance(tags, list) or any(t not in (*ALL, DRAFTER) for t in tags):
        return None
    own = set(tags) - {DRAFTER}
    if "kv_cache" in own:
        own.add("workspace")
    return canonical(own), DRAFTER in tags


@dataclass
class Background:
    """A generation left running across control calls, and what it may end with."""

    rid: str
    prompt: int
    max_new_tokens: int
    client: GenerationClient      # a stream: its first event says the node admitted it
    where: str                    # "held" (by the sidecar, paused), "engine" (admitted), "refused"
    versions: set[str]            # versions served while it was in flight
    ended: bool = False           # the node surely finished it (drained or aborted); its answer may be on its way
    may_abort: bool = False
    refused_as: str | None = None


@dataclass
class NodeModel:
    """What SPEC, docs/api.md and SGLang 0.5.23 say the node's state is."""

    backup: str
    released: set[str] = field(default_factory=set)
    weights_valid: bool = True
    weights_kept: bool = True     # the last release of the weights kept their contents (a backup)
    version: str = "default"
    paused: bool = False          # the sidecar holds new generation
    engine_paused: bool = False   # retract or in_place: the engine itself keeps its requests
    running_possible: bool = False  # under in_place: requests may still hold KV in the engine
    cached: set[int] = field(default_factory=set)  # prompts whose KV may be in the prefix cache

    @property
    def can_step(self) -> bool:
        return not self.released and self.weights_valid

    @property
    def serving(self) -> bool:
        return self.can_step and not self.paused

    def refusal(self) -> str:
        return "node_released" if self.released else "weights_not_loaded"


class NodeMachine(RuleBasedStateMachine):
    """Drives one node; after every step its answers and its view must match :class:`NodeModel`."""

    def __init__(self, node: Node) -> None:
        super().__init__()
        self.node = node
        self.http = httpx.Client(base_url=node.url, timeout=60)
        self.model = NodeModel(node.backup, weights_kept=node.backup != "none")
        self.model.cached.update(range(len(PROMPTS)))  # earlier examples' and the reference's prompts
        self.bg: list[Background] = []
        self.num_rids = 0  # generations started in the background (a bound on them: the steps stay replayable)

    # -- sending and checking ---------------------------------------------------------
    def call(self, path: str, body: Any, allowed: set[Outcome]) -> tuple[Outcome, dict[str, Any]]:
        """POST ``body``; the answer must be one of ``allowed`` and, if refused, the error envelope."""
        r = self.http.post(path, json=body)
        answer = r.json()
        assert r.status_code != 500, (path, body, r.text)
        if r.status_code >= 400:
            error = answer["error"]
            assert isinstance(error["message"], str) and error["message"], r.text
            outcome: Outcome = (r.status_code, error["type"])
            assert STATUS_OF.get(error["type"], r.status_code) == r.status_code, r.text
        else:
            outcome = (r.status_code, None)
        assert outcome in allowed, (path, body, outcome, sorted(allowed, key=str), r.text)
        return outcome, answer

    def engine_busy(self) -> list[Background]:
        """Admitted generations the node may still hold."""
        return [b for b in self.bg if b.where == "engine" and not b.ended and b.client.is_alive()]

    def end_all(self, *, aborted: bool) -> None:
        for b in self.bg:
            if b.where == "engine":
                b.ended = True
                b.may_abort = b.may_abort or aborted

    def forget_cache(self) -> None:
        """The prefix cache was emptied: only admitted generations may fill it again (a retracted one recomputes
        its prompt, one that could not step runs now, and each leaves its KV when it ends)."""
        self.model.cached = {b.prompt for b in self.bg if b.where == "engine"}

    def set_version(self, version: str | None) -> None:
        if version is not None:
            self.model.version = version
            for b in self.bg:
                b.versions.add(version)

    def check_generation(self, prompt: int, max_new_tokens: int, answer: dict[str, Any], versions: set[str],
                         may_abort: bool) -> None:
        ids, meta = answer["output_ids"], answer["meta_info"]
        expected = self.node.reference[prompt][:max_new_tokens]
        finish = meta["finish_reason"]["type"]
        if finish == "abort" and may_abort:
            assert ids == expected[:len(ids)], (ids, expected)
        else:
            assert finish == "length" and ids == expected, (finish, ids, expected)
        assert meta["weight_version"] in versions, (meta["weight_version"], versions)
        spans = meta["weight_versions"]  # which version made which tokens: in order, each served while it ran
        assert [(s["start"], s["end"]) for s in spans] == list(zip([0] + [s["end"] for s in spans[:-1]],
                                                                   [s["end"] for s in spans])), spans
        assert (spans[-1]["end"] if spans else 0) == len(ids) and all(s["version"] in versions for s in spans), spans

    def collect(self, b: Background) -> None:
        result = b.client.finish()
        assert result.status != 500 and result.error is None, result
        assert b.where != "held", f"a held request answered while paused: {result}"
        if result.status == 503 and b.refused_as is not None:
            assert result.body["error"]["type"] == b.refused_as and result.retry_after, result
        else:
            assert result.status == 200 and b.where == "engine" and result.saw_done, (b, result)
            self.check_generation(b.prompt, b.max_new_tokens, result.events[-1], b.versions, b.may_abort)
        self.bg.remove(b)

    def collect_done(self) -> None:
        for b in [b for b in self.bg if not b.client.is_alive()]:
            self.collect(b)

    def wait_for(self, background: list[Background], timeout: float = 60) -> None:
        wait_until(lambda: not any(b.client.is_alive() for b in background), timeout=timeout,
                   what="generations to end")
        for b in background:
            self.collect(b)

    def held(self) -> list[Background]:
        return [b for b in self.bg if b.where == "held"]

    # -- memory ---------------------------------------------------------------------
    @rule(tags=TAGS, omit_tags=st.booleans(), mode=st.sampled_from([None, "wait", "abort"]),
          drain_timeout=st.sampled_from([None, DRAIN_S]), stage_to_cpu=st.sampled_from([None, True, False]),
          fault=FAULTS)
    def release(self, tags: list[str] | None, omit_tags: bool, mode: str | None, drain_timeout: float | None,
                stage_to_cpu: bool | None, fault: dict[str, Any] | None) -> None:
        self.collect_done()
        body = {key: value for key, value in (("mode", mode), ("drain_timeout", drain_timeout),
                                              ("stage_to_cpu", stage_to_cpu)) if value is not None}
        if not (omit_tags and tags is None):
            body["tags"] = tags
        model, asked = self.model, asked_tags(tags)
        if fault is not None:
            self.call("/release_memory_occupation", {**body, **fault}, {(400, "invalid_request")})
            return
        assert asked is not None
        names, drafter = asked
        todo = [t for t in names if t not in model.released]
        already = [t for t in names if t in model.released]
        allowed = {OK}
        if todo and stage_to_cpu and model.backup == "none":
            allowed = {(409, "no_weights_backup")}
        elif todo and mode != "abort" and model.paused:
            if model.engine_paused and model.running_possible and self.engine_busy():
                allowed.add((409, "requests_in_flight"))  # in_place: paused requests hold KV
        elif todo and mode != "abort" and self.engine_busy() and (model.engine_paused or not model.can_step):
            allowed.add((409, "drain_timeout"))  # they cannot end: the drain waits out its bound
        outcome, answer = self.call("/release_memory_occupation", body, allowed)
        if outcome != OK:
            return
        assert (answer["released"], answer["already_released"]) == (todo, already), (body, answer)
        assert sorted(answer["bytes_freed"]) == sorted(todo), answer  # measured per tag by this engine
        assert answer.get("not_present") == ([DRAFTER] if drafter else None), answer
        if not todo:
            return
        if mode == "abort":
            self.end_all(aborted=True)
        elif not model.paused:
            self.end_all(aborted=False)
        model.released.update(todo)
        if "weights" in todo:
            model.weights_kept = model.backup != "none" if stage_to_cpu is None else stage_to_cpu

    @rule(tags=TAGS, omit_tags=st.booleans(), fault=st.sampled_from([None] * 6 + [["vram"], "kv_cache"]))
    def resume(self, tags: list[str] | None, omit_tags: bool, fault: Any) -> None:
        self.collect_done()
        self.resume_tags(tags if fault is None else fault, omit=omit_tags)

    def resume_tags(self, tags: Any, *, omit: bool = False) -> None:
        body = {} if omit and tags is None else {"tags": tags}
        model, asked = self.model, asked_tags(tags)
        if asked is None:
            self.call("/resume_memory_occupation", body, {(400, "invalid_request")})
            return
        names, drafter = asked
        todo = [t for t in names if t in model.released]
        _, answer = self.call("/resume_memory_occupation", body, {OK})
        model.released.difference_update(todo)
        if "weights" in todo:
            model.weights_valid = model.weights_valid and model.weights_kept
        if "kv_cache" in todo:
            self.forget_cache()  # SPEC 2: every cached prefix is dropped
        assert sorted(answer["bytes_restored"]) == sorted(todo), answer
        expected = {"resumed": todo, "already_resident": [t for t in names if t not in todo],
                    "weights_valid": model.weights_valid, "serving": model.serving}
        assert {key: answer[key] for key in expected} == expected, (body, answer)
        assert answer.get("not_present") == ([DRAFTER] if drafter else None), answer

    # -- generation control -------------------------------------------------------------
    @rule(mode=st.sampled_from(["abort", "retract", "in_place", "wait"]))
    def pause(self, mode: str) -> None:
        self.collect_done()
        model = self.model
        allowed = {OK}
        if mode == "wait" and self.engine_busy() and (model.engine_paused or not model.can_step):
            allowed.add((409, "drain_timeout"))
        outcome, answer = self.call("/pause_generation", {"mode": mode}, allowed)
        if outcome != OK:
            return
        assert answer["paused"] is True and answer["mode"] == mode, answer
        if mode in ("abort", "wait"):
            self.end_all(aborted=mode == "abort")
        elif mode == "retract":
            model.running_possible = False
        elif not model.engine_paused:
            model.running_possible = bool(self.engine_busy())
        model.paused = True
        model.engine_paused = model.engine_paused or mode in ("retract", "in_place")

    @rule()
    def continue_generation(self) -> None:
        self.collect_done()
        self.continue_now()

    def continue_now(self) -> None:
        model = self.model
        _, answer = self.call("/continue_generation", {}, {OK})
        model.paused = model.engine_paused = model.running_possible = False
        assert answer["paused"] is False and answer["serving"] is model.serving, answer
        for b in self.held():  # admitted if the node serves, else refused with why (SPEC 3)
            b.where, b.refused_as = ("engine", None) if model.serving else ("refused", model.refusal())
            if model.serving:
                model.cached.add(b.prompt)  # it runs now, after any flush while it was held

    @rule()
    def flush_cache(self) -> None:
        self.collect_done()
        _, answer = self.call("/flush_cache", {}, {OK})
        assert answer["message"].startswith("Cache flushed."), answer
        self.forget_cache()

    @rule(which=st.sampled_from(["one", "unknown", "all"]))
    def abort_request(self, which: str) -> None:
        self.collect_done()
        mine = [b for b in self.bg if b.where == "engine"]
        body: dict[str, Any] = {"abort_all": True} if which == "all" else {
            "rid": mine[-1].rid if which == "one" and mine else "no-such-request"}
        self.call("/abort_request", body, {OK})
        # one held by the pause has not reached the engine: untouched, as at SGLang 0.5.23's pause gate (its abort
        # reaches a scheduler that does not have the request yet; the request runs after the continue)
        for b in mine:
            if which == "all" or b.rid == body.get("rid"):
                b.ended = b.may_abort = True

    # -- weights ------------------------------------------------------------------------
    @rule(good=st.sampled_from([True, True, True, False]), version=st.sampled_from([None, "v1", "v2", "default"]),
          abort_all=st.booleans())
    def update_weights_from_disk(self, good: bool, version: str | None, abort_all: bool) -> None:
        self.collect_done()
        self.reload(good, version, abort_all)

    def reload(self, good: bool, version: str | None, abort_all: bool) -> None:
        model = self.model
        path = self.node.checkpoint if good else self.node.checkpoint + "-missing"
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = version
        if abort_all:
            body["abort_all_requests"] = True
        if not good:
            self.call("/update_weights_from_disk", body, {(400, "invalid_request")})
            return
        drains = abort_all or not (model.paused or not model.can_step)
        _, answer = self.call("/update_weights_from_disk", body, {OK})
        if drains:
            self.end_all(aborted=abort_all)
        resumed = ["weights"] if "weights" in model.released else []
        model.released.discard("weights")
        model.weights_valid = True
        self.forget_cache()
        self.set_version(version)
        expected = {"weight_version": model.version, "weights_valid": True, "resumed": resumed,
                    "serving": model.serving}
        assert {key: answer[key] for key in expected} == expected, (body, answer)

    @rule(version=st.sampled_from(["v1", "v3", "default"]), abort_all=st.sampled_from([None, True, False]))
    def update_weight_version(self, version: str, abort_all: bool | None) -> None:
        self.collect_done()
        body: dict[str, Any] = {"new_version": version}
        if abort_all is not None:
            body["abort_all_requests"] = abort_all
        _, answer = self.call("/update_weight_version", body, {OK})
        assert answer["new_version"] == version, answer
        if abort_all is not False:  # SGLang's default: true
            self.end_all(aborted=True)
        self.set_version(version)

    # -- generation -----------------------------------------------------------------------
    @rule(prompt=st.integers(0, len(PROMPTS) - 1), max_new_tokens=st.integers(1, 8))
    def generate(self, prompt: int, max_new_tokens: int) -> None:
        self.collect_done()
        model = self.model
        if model.paused:  # held until the continue: it runs in the background
            self.generate_in_background(prompt, max_new_tokens)
            return
        r = self.http.post("/generate", json=generate_body(PROMPTS[prompt], max_new_tokens))
        if not model.serving:
            assert r.status_code == 503 and r.json()["error"]["type"] == model.refusal(), r.text
            assert r.headers.get("retry-after"), r.headers
            return
        assert r.status_code == 200, r.text
        self.check_served(prompt, max_new_tokens, r.json())

    def check_served(self, prompt: int, max_new_tokens: int, answer: dict[str, Any]) -> None:
        """A generation answered at once by a serving node: the fresh node's greedy ids, the version served now,
        and no KV reused that a flush or a resume emptied."""
        model = self.model
        self.check_generation(prompt, max_new_tokens, answer, {model.version}, may_abort=False)
        if prompt not in model.cached:
            assert answer["meta_info"]["cached_tokens"] <= 1, answer["meta_info"]  # 1: the BOS all prompts share
        model.cached.add(prompt)

    @precondition(lambda self: self.num_rids < 6)
    @rule(prompt=st.integers(0, len(PROMPTS) - 1), max_new_tokens=st.sampled_from([60, REF_TOKENS]),
          then_pause=st.sampled_from([None, None, "abort", "retract", "in_place", "wait"]))
    def generate_in_background(self, prompt: int, max_new_tokens: int, then_pause: str | None = None) -> None:
        """A generation left running; ``then_pause``: a pause follows at once, while it surely runs (as an RL
        step pauses its rollouts)."""
        self.collect_done()
        model = self.model
        if not model.serving and not model.paused:
            self.generate(prompt, min(max_new_tokens, 8))  # refused at once
            return
        self.num_rids += 1
        rid = f"bg-{self.num_rids}-{time.monotonic_ns()}"
        client = GenerationClient(self.node.url + "/generate",
                                  {**generate_body(PROMPTS[prompt], max_new_tokens, rid), "stream": True})
        b = Background(rid, prompt, max_new_tokens, client, "held" if model.paused else "engine", {model.version})
        self.bg.append(b)
        model.cached.add(prompt)
        client.start()
        if b.where == "held":
            num = len(self.held())
            wait_until(lambda: self.view()["held"] == num, timeout=10, what=f"{num} held request(s)")
        else:  # admitted (its first event) before the next step, which may close admission
            assert client.started_streaming.wait(10), "no first event"
        if then_pause is not None:
            self.pause(then_pause)

    @rule(rollout=st.sampled_from([None, 60, REF_TOKENS]), pause=st.sampled_from(["abort", "retract", "in_place"]),
          release_tags=TAGS, release_mode=st.sampled_from([None, "wait", "abort"]),
          reload=st.sampled_from([None, "v1", "v2"]), resume_tags=TAGS)
    def rl_step(self, rollout: int | None, pause: str, release_tags: list[str] | None, release_mode: str | None,
                reload: str | None, resume_tags: list[str] | None) -> None:
        """SPEC 1's RL step, each call checked as it is answered: rollouts (one left running), pause, release,
        the trainer's turn, reload (or not), resume, continue."""
        if rollout is not None and self.num_rids < 6 and self.model.serving:
            self.generate_in_background(0, rollout)
        self.pause(pause)
        for step in (lambda: self.release(release_tags, False, release_mode, None, None, None),
                     lambda: reload is not None and self.reload(True, reload, abort_all=False),
                     lambda: self.resume_tags(resume_tags),
                     self.continue_now):
            self.view_matches_model()
            step()

    @rule()
    def settle(self) -> None:
        """Wait for the generations that can end: ended by the node, or running on a node that steps."""
        steps = self.model.can_step and not self.model.engine_paused
        self.wait_for([b for b in self.bg if b.where == "refused" or (b.where == "engine" and (b.ended or steps))])

    # -- the node's view ----------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        r = self.http.get("/memory_occupation")
        assert r.status_code == 200, r.text
        return r.json()

    @invariant()
    def view_matches_model(self) -> None:
        model, view = self.model, self.view()
        states = {t: view["tags"][t]["state"] for t in ALL}
        assert states == {t: "released" if t in model.released else "resident" for t in ALL}, (states, model)
        admission = "open" if model.serving else "holding" if model.paused else "closed"
        expected = {"weights_valid": model.weights_valid, "weight_version": model.version, "paused": model.paused,
                    "serving": model.serving, "admission": admission, "held": len(self.held()),
                    "engine_reachable": True}
        assert {key: view[key] for key in expected} == expected, (view, model)
        assert self.http.get("/get_weight_version").json() == {"weight_version": model.version}

    @invariant()
    def serving_node_generates(self) -> None:
        """While the model says it serves, every prompt is answered at once and right (a batch, so it is cheap)."""
        if not self.model.serving:
            return
        r = self.http.post("/generate", json={"text": list(PROMPTS), "sampling_params": {
            "temperature": 0, "ignore_eos": True, "max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        for prompt, answer in enumerate(r.json()):
            self.check_served(prompt, 3, answer)

    @invariant()
    def probes_match_model(self) -> None:
        """SPEC 3: ``/ready`` only while serving; ``/health_generate`` a token then, else why, untouched."""
        model = self.model
        assert self.http.get("/ready").status_code == (200 if model.serving else 503)
        r = self.http.get("/health_generate")
        reason = model.refusal() if not model.can_step else "generation_paused"
        expected = ({"serving": True, "success": True, "weight_version": model.version} if model.serving else
                    {"serving": False, "reason": reason, "released": canonical(model.released)})
        assert (r.status_code, r.json()) == (200, expected), r.text

    def teardown(self) -> None:
        """Back to a fresh node through the API: every tag resident, the checkpoint reloaded under the first
        version, generation continued; every generation answered, nothing left in flight or held."""
        try:
            self.resume_tags(None)
            self.reload(True, "default", abort_all=False)
            self.continue_now()
            self.wait_for(list(self.bg))
            view = self.view()
            assert view["serving"] and view["in_flight"] == 0 and view["held"] == 0, view
        finally:
            self.http.close()


def test_node_answers_as_its_model(node: Node) -> None:
    run_state_machine_as_test(lambda: NodeMachine(node), settings=settings(
        # the same sequences every run (CI is no place to find a new one; runs of 500 examples explored wider)
        max_examples=15, stateful_step_count=20, deadline=None, database=None, print_blob=True, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
