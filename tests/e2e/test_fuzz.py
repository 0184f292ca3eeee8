"""Property-based fuzzing (issue 8) of every endpoint of the LB and of a sidecar, on a real cluster.

Every route each process documents in its own ``/openapi.json`` is fuzzed (the
test fails if one is missing from the inventory below): wrong JSON types in known
bodies, unknown fields, arbitrary JSON, invalid UTF-8, deeply nested and large
bodies, wrong content types, odd methods and query strings. Properties:

- never a 5xx, except the LB's SPEC 4 502 for a control call that every node
  refused with a 4xx (the nodes judged the body; nothing changed anywhere);
- never a state change: after every request, the LB's ``/nodes`` and each
  sidecar's ``/memory_occupation`` are what they were before the first one;
- the processes keep serving: all alive, a generation through the LB works.

Bodies that are valid *and* would change state on purpose (a well-formed release
or pause, ``POST /nodes`` of a valid node) or run long (a valid generation asking
for more than a few tokens) are not sent: changing state is their job, not a bug.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from handoff.cluster.local import ClusterSpec, LocalCluster
from lb.routes_nodes import AddNode
from lb.workers import WorkerBody
from node_engine.server.openai_bodies import ChatCompletionBody, CompletionBody
from node_engine.server.protocol import GenerateBody
from handoff.protocol.control import PauseBody, ReleaseBody
from handoff.protocol.weights import BeginWeightUpdateBody, InitWeightsUpdateGroupBody, UpdateWeightVersionBody

pytestmark = pytest.mark.timeout(300)

ALL_TAGS = ("weights", "kv_cache", "cuda_graph", "workspace")
MAX_TOKENS_SENT = 8  # a valid generation asking for more (or for the default) is not sent
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain", "application/xml",
              "application/x-www-form-urlencoded", "multipart/form-data; boundary=xyz", "", "json", "*/*"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]

# a valid body per path, which the strategies break one field at a time
TEMPLATES: dict[str, dict[str, Any]] = {
    "/release_memory_occupation": {"tags": ["weights", "kv_cache"], "mode": "wait", "drain_timeout": 5.0,
                                   "stage_to_cpu": True},
    "/resume_memory_occupation": {"tags": ["kv_cache"]},
    "/update_weights_from_disk": {"model_path": "/nonexistent/ckpt", "weight_version": "v2", "drain_timeout": 5.0},
    "/pause_generation": {"mode": "abort", "drain_timeout": 5.0},
    "/continue_generation": {},
    "/flush_cache": {},
    "/abort_request": {"rid": "nope", "abort_all": False},
    "/update_weights_from_tensor": {"serialized_named_tensors": ["gARdlC4="], "load_format": None,
                                    "flush_cache": True, "weight_version": "v2"},
    "/update_weights_from_distributed": {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                         "group_name": "g", "flush_cache": True},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "group_name": "g", "backend": "gloo"},
    "/destroy_weights_update_group": {"group_name": "g"},
    "/begin_weight_update": {"selector": "all"},
    "/end_weight_update": {},
    "/update_weight_version": {"new_version": "v2", "abort_all_requests": False},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0.5, "top_p": 0.9,
                                                    "top_k": 3, "stop": ["x"], "ignore_eos": True, "seed": 1},
                  "stream": False, "rid": "r1"},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0.5, "stream": False},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "stream": False},
    "/nodes": {"url": "http://127.0.0.1:1", "role": "mixed", "bootstrap_port": None},
    "/workers": {"url": "http://127.0.0.1:1", "worker_type": "regular", "bootstrap_port": None},
    "/weights_checker": {"action": "checksum", "skip_tensor_list": ["lm_head"]},  # read-only: changes nothing
}

# every route each process serves, with the method it documents (checked against /openapi.json)
LB_ROUTES = [("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
             ("GET", "/flush_cache"), ("POST", "/flush_cache"), ("POST", "/update_weights_from_disk"),
             ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/generate"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/nodes"),
             ("POST", "/nodes"), ("DELETE", "/nodes"), ("GET", "/memory_occupation"), ("GET", "/metrics"),
             ("GET", "/openapi.json"), ("POST", "/update_weights_from_tensor"),
             ("POST", "/update_weights_from_distributed"), ("POST", "/init_weights_update_group"),
             ("POST", "/destroy_weights_update_group"), ("POST", "/begin_weight_update"),
             ("POST", "/end_weight_update"), ("POST", "/update_weight_version"), ("POST", "/abort_request"),
             ("GET", "/get_weight_version"), ("POST", "/add_worker"), ("POST", "/remove_worker"),
             ("GET", "/list_workers"), ("POST", "/workers"), ("GET", "/workers"),
             ("DELETE", "/workers/{id_or_url}"), ("GET", "/model_info"), ("GET", "/get_model_info"),
             ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/get_server_info"),
             ("GET", "/server_info"), ("GET", "/health_generate"), ("GET", "/weights_checker"),
             ("POST", "/weights_checker"), ("GET", "/workers/{id_or_url}")]
SIDECAR_ROUTES = [("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                  ("GET", "/health_generate"), ("POST", "/release_memory_occupation"),
                  ("POST", "/resume_memory_occupation"), ("POST", "/update_weights_from_disk"),
                  ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("GET", "/flush_cache"),
                  ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/v1/models"),
                  ("GET", "/get_server_info"), ("GET", "/memory_occupation"), ("GET", "/health"), ("GET", "/ready"),
                  ("GET", "/metrics"), ("GET", "/openapi.json"), ("POST", "/update_weights_from_tensor"),
                  ("POST", "/update_weights_from_distributed"), ("POST", "/init_weights_update_group"),
                  ("POST", "/destroy_weights_update_group"), ("POST", "/begin_weight_update"),
                  ("POST", "/end_weight_update"), ("POST", "/update_weight_version"), ("GET", "/get_weight_version"),
                  ("GET", "/get_model_info"), ("GET", "/model_info"),
                  ("GET", "/v1/models/{model}"), ("GET", "/server_info"), ("GET", "/weights_checker"),
                  ("POST", "/weights_checker"), ("GET", "/v1/loads")]

json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def broken_template(draw: st.DrawFn, path: str) -> bytes:
    """The path's valid body with fields given wrong values and unknown fields added."""
    body = json.loads(json.dumps(TEMPLATES.get(path, {})))
    for key in draw(st.lists(st.sampled_from(sorted(body) or ["x"]), max_size=3, unique=True)):
        body[key] = draw(json_values)
    for key in draw(st.lists(st.text(min_size=1, max_size=12), max_size=2)):
        body[key] = draw(json_values)
    if isinstance(body.get("sampling_params"), dict) and body["sampling_params"] and draw(st.booleans()):
        params = body["sampling_params"]
        params[draw(st.sampled_from(sorted(params)))] = draw(json_values)
    return json.dumps(body).encode()


def deeply_nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    kind = draw(st.sampled_from(["template", "template", "template", "json", "bytes", "nested", "large", "empty"]))
    if kind == "template":
        return draw(broken_template(path))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "bytes":  # often not UTF-8 at all
        return draw(st.binary(max_size=64) | st.just(b'{"text": "\xff\xfe"}') | st.just(b'{"tags": ["\xc3"]}'))
    if kind == "nested":
        return deeply_nested(draw(st.sampled_from([100, 1000, 100_000])), draw(st.sampled_from(["list", "dict"])))
    if kind == "large":  # a few MiB, under the 64 MiB limit: judged, not refused for size
        size = draw(st.sampled_from([1 << 16, 1 << 20, 3 << 20]))
        filler = "é" * (size // 2)
        choices = [json.dumps({"text": filler}), json.dumps({"unknown": filler}), json.dumps([filler]),
                   '{"tags": ["' + filler]
        return draw(st.sampled_from(choices)).encode()
    return b""


def query_strings() -> st.SearchStrategy[str]:
    keys = st.sampled_from(["role", "timeout", "url", "stream", "x", "", "role[]"]) | st.text(max_size=6)
    # a valid short ?timeout= could make the nodes miss it (a 502 that is the caller's asking): not sent
    values = st.text(max_size=12).filter(lambda v: not _is_short_timeout(v))
    pairs = st.lists(st.tuples(keys, values), max_size=3)
    return pairs.map(lambda items: "&".join(f"{quote(k)}={quote(v)}" for k, v in items))


def _is_short_timeout(value: str) -> bool:
    try:
        return 0 < float(value) < 30
    except ValueError:
        return False


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    query: str
    content_type: str
    body: bytes


def calls(routes: list[tuple[str, str]]) -> st.SearchStrategy[Call]:
    @st.composite
    def one(draw: st.DrawFn) -> Call:
        method, path = draw(st.sampled_from(routes))
        if draw(st.integers(0, 9)) == 0:
            method = draw(st.sampled_from(METHODS))
        return Call(method, path, draw(query_strings()), draw(st.sampled_from(JSON_TYPES)), draw(bodies(path)))
    return one()


# -- bodies that do their job (change state, or run long) are not sent -------------------------------------------

def _parsed(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _validates(model: type[BaseModel], value: Any) -> bool:
    try:
        model.model_validate(value)
    except ValidationError:
        return False
    return True


def _asks_many_tokens(value: Any) -> bool:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("max_new_tokens", "max_tokens", "max_completion_tokens") and not (
                    isinstance(item, int) and item <= MAX_TOKENS_SENT):
                return True
            if _asks_many_tokens(item):
                return True
    elif isinstance(value, list):
        return any(_asks_many_tokens(item) for item in value)
    return False


GENERATION_MODELS: dict[str, tuple[type[BaseModel], str]] = {
    "/generate": (GenerateBody, "sampling_params"), "/v1/completions": (CompletionBody, "max_tokens"),
    "/v1/chat/completions": (ChatCompletionBody, "max_tokens")}


def does_its_job(call: Call) -> bool:
    """A body that is valid for a state-changing call, or a generation that would run long."""
    if call.method not in ("POST", "DELETE"):
        return False
    value = _parsed(call.body)
    is_empty = not call.body.strip()
    if call.path in ("/release_memory_occupation", "/pause_generation") and call.method == "POST":
        model = ReleaseBody if call.path == "/release_memory_occupation" else PauseBody
        tags = value.get("tags") if isinstance(value, dict) else None
        known_tags = tags is None or (isinstance(tags, list)
                                      and all(isinstance(t, str) and t in ALL_TAGS for t in tags))
        return is_empty or (isinstance(value, dict) and _validates(model, value) and known_tags)
    if call.path == "/nodes" and call.method == "POST":
        return isinstance(value, dict) and _validates(AddNode, value)
    if call.path == "/workers" and call.method == "POST":
        return isinstance(value, dict) and _validates(WorkerBody, value)
    if call.path in ("/add_worker", "/remove_worker"):
        return "url=" in call.query  # a member added or removed
    if call.path == "/update_weights_from_disk":
        return isinstance(value, dict) and str(value.get("model_path", "")).startswith("builtin")
    # a valid join waits for a trainer; a valid session or version call changes what the node serves
    state_changing = {"/init_weights_update_group": InitWeightsUpdateGroupBody,
                      "/begin_weight_update": BeginWeightUpdateBody, "/update_weight_version": UpdateWeightVersionBody}
    if call.path in state_changing and call.method == "POST":
        return is_empty or (isinstance(value, dict) and _validates(state_changing[call.path], value))
    if call.path in GENERATION_MODELS and call.method == "POST" and isinstance(value, dict):
        model, _ = GENERATION_MODELS[call.path]
        if _validates(model, value):
            params = value.get("sampling_params")  # one object, or one per prompt (then: taken as long)
            limit = (params.get("max_new_tokens") if isinstance(params, dict) else None) \
                if call.path == "/generate" else value.get("max_tokens")
            return _asks_many_tokens(value) or not isinstance(limit, int) or limit > MAX_TOKENS_SENT
    return False


# -- the cluster and what its state is ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(ClusterSpec(num_mixed=2, weights_backup="disk"), tmp_path_factory.mktemp("fuzz")) as c:
        yield c


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def state(cluster: LocalCluster, http: httpx.Client) -> dict[str, Any]:
    """What must not change: each node's state as the LB and as its sidecar see it.

    ``GET /memory_occupation`` of the LB checks every node first, so ``/nodes`` is fresh, not what a
    periodic check saw in the middle of a call (a sidecar closes admission while it drains for a reload,
    even one the engine then refuses with a 400).
    """
    http.get(cluster.url + "/memory_occupation").raise_for_status()
    lb_view = {n["url"]: {k: n[k] for k in ("health", "routable", "serving", "admission", "tags",
                                           "weights_valid", "weight_version")}
               for n in http.get(cluster.url + "/nodes").json()["nodes"]}
    for view in lb_view.values():
        view["tags"] = {tag: t["state"] for tag, t in view["tags"].items()}
    sidecars = {}
    for node in cluster.nodes:
        occupation = http.get(node.url + "/memory_occupation").json()
        sidecars[node.url] = {"serving": occupation["serving"], "admission": occupation["admission"],
                              "paused": occupation["paused"], "weights_valid": occupation["weights_valid"],
                              "weight_version": occupation["weight_version"], "held": occupation["held"],
                              "tags": {tag: t["state"] for tag, t in occupation["tags"].items()}}
    return {"lb": lb_view, "sidecars": sidecars}


def is_allowed_5xx(answer: httpx.Response, *, is_lb: bool) -> bool:
    """The LB's SPEC 4 502 for a control call every node refused with a 4xx."""
    if not is_lb or answer.status_code != 502:
        return False
    try:
        body = answer.json()
    except ValueError:
        return False
    failures = body.get("failures", []) if isinstance(body, dict) else []
    return bool(failures) and not body.get("succeeded") and all(
        f.get("reason") == "http_status" and 400 <= f.get("status", 0) < 500 for f in failures)


def send(http: httpx.Client, base: str, call: Call) -> httpx.Response:
    headers = {"Content-Type": call.content_type} if call.content_type else {}
    url = base + call.path + (f"?{call.query}" if call.query else "")
    return http.request(call.method, url, content=call.body, headers=headers)


def check_fuzzed(cluster: LocalCluster, http: httpx.Client, base: str, call: Call, before: dict[str, Any],
                 *, is_lb: bool) -> int:
    """Send ``call`` and check the properties; returns the status."""
    assume(not does_its_job(call))
    answer = send(http, base, call)
    assert answer.status_code < 500 or is_allowed_5xx(answer, is_lb=is_lb), (call, answer.status_code,
                                                                               answer.text[:500])
    if answer.status_code >= 400 and answer.headers.get("content-type", "").startswith("application/json"):
        assert set(answer.json()["error"]) >= {"type", "message"}, answer.text[:300]
    assert state(cluster, http) == before, (call, answer.status_code, answer.text[:300])
    return answer.status_code


FUZZ = settings(max_examples=250, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])


def served_routes(http: httpx.Client, base: str) -> set[tuple[str, str]]:
    spec = http.get(base + "/openapi.json").json()
    return {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops} | {
        ("GET", "/openapi.json")}


def test_the_inventory_is_every_documented_route(cluster: LocalCluster, http: httpx.Client) -> None:
    assert served_routes(http, cluster.url) == set(LB_ROUTES)
    assert served_routes(http, cluster.nodes[0].url) == set(SIDECAR_ROUTES)


@pytest.fixture(scope="module")
def baseline(cluster: LocalCluster, http: httpx.Client) -> dict[str, Any]:
    before = state(cluster, http)
    assert all(v["routable"] for v in before["lb"].values())
    return before


def test_fuzz_the_lb(cluster: LocalCluster, http: httpx.Client, baseline: dict[str, Any]) -> None:
    statuses: Counter[int] = Counter()

    @FUZZ
    @given(call=calls(LB_ROUTES))
    def fuzz(call: Call) -> None:
        statuses[check_fuzzed(cluster, http, cluster.url, call, baseline, is_lb=True)] += 1

    fuzz()
    assert_still_serving(cluster, http)
    assert_fuzzed_enough(statuses)


def test_fuzz_a_sidecar(cluster: LocalCluster, http: httpx.Client, baseline: dict[str, Any]) -> None:
    sidecar = cluster.nodes[0].url

    statuses: Counter[int] = Counter()

    @FUZZ
    @given(call=calls(SIDECAR_ROUTES))
    def fuzz(call: Call) -> None:
        statuses[check_fuzzed(cluster, http, sidecar, call, baseline, is_lb=False)] += 1

    fuzz()
    assert_still_serving(cluster, http)
    assert_fuzzed_enough(statuses)


def assert_fuzzed_enough(statuses: Counter[int]) -> None:
    """Most examples were sent (not filtered out) and they met both answers, refusals and successes."""
    assert sum(statuses.values()) >= FUZZ.max_examples * 0.6, statuses
    assert statuses[400] > 0 and any(200 <= status < 300 for status in statuses), statuses


def assert_still_serving(cluster: LocalCluster, http: httpx.Client) -> None:
    assert not cluster.dead_processes()
    for base in [cluster.url, *(n.url for n in cluster.nodes)]:
        answer = http.post(base + "/generate", json={"text": "still there?", "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}})
        assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 3


def test_the_fuzzer_finds_what_it_is_meant_to(cluster: LocalCluster, http: httpx.Client,
                                              baseline: dict[str, Any]) -> None:
    """The checks bite: a body that releases is a state change, a refused release through the LB is the one
    allowed 5xx, and the filter recognises the bodies it keeps back."""
    release = Call("POST", "/release_memory_occupation", "", "application/json", b'{"tags": ["kv_cache"]}')
    assert does_its_job(release) and does_its_job(Call("POST", "/pause_generation", "", "", b""))
    assert not does_its_job(Call("POST", "/release_memory_occupation", "", "", b'{"tags": ["vram"]}'))
    assert does_its_job(Call("POST", "/generate", "", "", b'{"text": "x"}'))  # default length: long
    assert not does_its_job(Call("POST", "/generate", "", "", b'{"text": "x", "sampling_params": '
                                                                b'{"max_new_tokens": 2}}'))
    refused = send(http, cluster.url, Call("POST", "/release_memory_occupation", "", "application/json",
                                           b'{"tags": ["vram"]}'))
    assert is_allowed_5xx(refused, is_lb=True)
    answer = send(http, cluster.url, release)
    assert answer.status_code == 200
    try:
        assert state(cluster, http) != baseline
    finally:
        http.post(cluster.url + "/resume_memory_occupation", json={}).raise_for_status()
    assert state(cluster, http) == baseline


def test_fuzz_strategies_cover_each_kind_of_bad_input() -> None:
    """The kinds of input the issue names are all reachable by the strategies (a cheap, no-network check)."""
    seen: set[str] = set()

    @settings(max_examples=300, database=None, deadline=None)
    @given(body=bodies("/release_memory_occupation"), query=query_strings(), content_type=st.sampled_from(JSON_TYPES))
    def sample(body: bytes, query: str, content_type: str) -> None:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            seen.add("invalid utf-8")
        if len(body) > 1 << 19:
            seen.add("large")
        if body.startswith(b"[[[[") or body.startswith(b'{"a": {"a"'):
            seen.add("nested")
        value = _parsed(body)
        if isinstance(value, dict) and set(value) - set(TEMPLATES["/release_memory_occupation"]):
            seen.add("unknown field")
        if isinstance(value, dict) and any(type(value.get(k)) is not type(v)
                                           for k, v in TEMPLATES["/release_memory_occupation"].items() if k in value):
            seen.add("wrong type")
        if query:
            seen.add("query")
        if content_type != "application/json":
            seen.add("content type")

    sample()
    assert seen == {"invalid utf-8", "large", "nested", "unknown field", "wrong type", "query", "content type"}

