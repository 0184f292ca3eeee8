"""The vLLM weight-sync pieces that need no vLLM: the worker extension's check of an update against the served
checkpoint (names, shapes, dtypes, whole fused layers), its refusal of unsafe payloads, and the sidecar side's
answers without the extension and for SGLang's session. The real thing: tests/vllm/test_vllm_weight_sync.py."""

from __future__ import annotations

import asyncio
import base64
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from handoff.service.errors import InvalidRequest, Unsupported
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from node_sidecar.engines.vllm_weights import VllmWeightSync
from node_sidecar.engines.vllm_worker_ext import HandoffWeightSync
from node_sidecar.errors import EngineRefused

LLAMA_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class Worker(HandoffWeightSync):
    """What the extension reads of vLLM's worker: the served folder and the model's fused layers."""

    def __init__(self, folder: Path) -> None:
        model = SimpleNamespace(packed_modules_mapping=LLAMA_FUSED, parameters=lambda: [])
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(folder)))
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.loaded: list[str] = []

    def reload_weights(self, *, weights_iterator, is_checkpoint_format: bool) -> None:
        self.loaded = [name for name, _ in weights_iterator]


def check(worker: Worker, named: dict) -> str | None:
    return worker._handoff_check(list(named), [list(t.shape) for t in named.values()],
                                 [str(t.dtype).removeprefix("torch.") for t in named.values()])


def test_an_update_is_checked_against_the_served_checkpoint_and_whole_fused_layers(tmp_path: Path) -> None:
    arch = builtin_arch("builtin:tiny")
    weights = builtin_weights(arch, 0)
    save_checkpoint(tmp_path, arch, weights)
    worker = Worker(tmp_path)
    assert check(worker, weights) is None
    layer_0 = {n: t for n, t in weights.items() if n.startswith("model.layers.0.")}
    assert check(worker, layer_0) is None  # whole layers: the others keep their weights
    q_only = {n: t for n, t in layer_0.items() if "q_proj" in n}
    assert "loads the layer model.layers.0.self_attn.qkv_proj whole" in check(worker, q_only)
    gate_only = {n: t for n, t in layer_0.items() if "gate_proj" in n}
    assert "model.layers.0.mlp.gate_up_proj whole" in check(worker, gate_only)
    name = "model.norm.weight"
    assert "does not match" in check(worker, {name: weights[name][:-1]})
    assert "not a tensor of this model" in check(worker, {"model.extra.weight": weights[name]})
    assert "not a floating" in check(worker, {name: weights[name].long()})
    assert worker.handoff_update_from_tensor(["AAAA"])["error"] == "invalid_request"
    assert worker.loaded == []
    unreadable = Worker(tmp_path / "gone")  # the served folder went away: nothing can be checked, nothing loads
    assert "cannot be read to check the update" in check(unreadable, {name: weights[name]})


def test_a_payload_naming_a_callable_is_refused_before_anything_runs(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    worker = Worker(tmp_path)
    answer = worker.handoff_update_from_tensor([base64.b64encode(pickle.dumps(Evil())).decode()])
    assert answer["ok"] is False and "builtins.print" in answer["message"] and worker.loaded == []


def test_without_the_extension_the_calls_say_how_to_enable_it_and_the_session_is_one_at_a_time() -> None:
    sync = VllmWeightSync(engine=None)
    with pytest.raises(Unsupported, match="--worker-extension-cls node_sidecar.engines.vllm_worker_ext"):
        sync.session_call("/begin_weight_update", {})
    sync.extension = "node_sidecar.engines.vllm_worker_ext.HandoffWeightSync"
    assert sync.session_call("/begin_weight_update", {"selector": "all"})["success"] is True
    with pytest.raises(InvalidRequest, match="already open"):
        sync.session_call("/begin_weight_update", {})
    assert sync.session_call("/end_weight_update", {})["success"] is True
    with pytest.raises(InvalidRequest, match="no weight update session"):
        sync.session_call("/end_weight_update", {})


class ResettingEngine:
    """vLLM's HTTP surface as an update uses it; ``/reset_prefix_cache`` fails ``num_refusals`` times first
    (vLLM answers ``success: false`` while running requests hold blocks; with ``reset_running_requests=true`` it
    raises instead, a 500: ``v1/core/sched/scheduler.py`` ``reset_prefix_cache``)."""

    base_url = "http://127.0.0.1:9"

    def __init__(self, num_refusals: int) -> None:
        self.num_refusals = num_refusals
        self.paths: list[str] = []

    async def call(self, method: str, path: str, body: object = None, **_: object) -> dict:
        self.paths.append(path)
        if path.startswith("/reset_prefix_cache"):
            self.num_refusals -= 1
            if self.num_refusals >= 0 and path.endswith("reset_running_requests=true"):
                raise EngineRefused(500, {"error": {"message": "Internal Server Error"}})
            return {"success": self.num_refusals < 0}
        return {}


async def test_an_update_resets_the_prefix_cache_or_says_it_could_not() -> None:
    """An update's prefix-cache reset was sent once and its answer ignored: a refused reset (running requests
    hold blocks) answered success with the old weights' prefixes still cached (found by review). A refused reset
    is sent again preempting the running requests; refused again (vLLM's 500), the update says the cache was not
    flushed: vLLM's 500 was passed on as the sidecar's, as if the update had failed."""
    from handoff.service.errors import Conflict
    from node_sidecar.engines import vllm

    body = {"model_path": "/ckpt", "weight_version": "v2"}
    engine = ResettingEngine(num_refusals=1)
    answer = await vllm.VllmEngine(engine).update_weights_from_disk(body)
    assert answer["success"] is True and answer["weight_version"] == "v2"
    assert [p for p in engine.paths if p.startswith("/reset")] == [
        "/reset_prefix_cache", "/reset_prefix_cache?reset_running_requests=true"]
    engine = ResettingEngine(num_refusals=2)
    with pytest.raises(Conflict) as refused:
        await vllm.VllmEngine(engine).update_weights_from_disk(body)
    assert refused.value.type == "requests_in_flight"
    assert "the weights are updated (version 'v2')" in refused.value.message
    from node_sidecar.errors import LoadedNotFlushed  # the answer the node records as a success's (control.py)
    assert isinstance(refused.value, LoadedNotFlushed) and refused.value.answer["weight_version"] == "v2"
    assert refused.value.answer["success"] is True
    assert "call /flush_cache" in refused.value.message
    engine = ResettingEngine(num_refusals=2)
    with pytest.raises(Conflict) as refused:  # not vLLM's 500 passed on as the sidecar's
        await vllm.VllmEngine(engine).flush_cache(5)
    assert refused.value.type == "requests_in_flight" and "preempted" in refused.value.message
    engine = ResettingEngine(num_refusals=1000)
    answer = await vllm.VllmEngine(engine).update_weights_from_disk({**body, "flush_cache": False})
    assert answer["success"] is True and not any(p.startswith("/reset") for p in engine.paths)


class OddViewEngine:
    """vLLM's view endpoints answering values of the wrong types (a hostile or broken engine)."""

    base_url = "http://127.0.0.1:9"

    async def call(self, method: str, path: str, body: object = None, **_: object) -> dict:
        if path.startswith("/server_info"):
            return {"vllm_config": {"device_config": {"device": {"kind": "cpu"}},
                                    "parallel_config": {"worker_extension_cls": ["a", "b"]},
                                    "model_config": {"model": 7, "enable_sleep_mode": "yes"}}}
        if path == "/is_sleeping":
            return {"is_sleeping": "true"}
        if path == "/weight_info":
            return {"weight_version": 3}
        return {"version": {"major": 0}}


async def test_a_view_of_the_wrong_types_is_not_adopted() -> None:
    """``device``, ``worker_extension_cls`` and ``version`` were kept whatever their type (the device as the
    text of a whole object; a list taken for an extension's class name): each is kept only as a string now, as
    ``weight_version`` and the model path were (found by review)."""
    from node_sidecar.engines import vllm

    adapter = vllm.VllmEngine(OddViewEngine())
    view = await adapter.read_view()
    assert adapter.device == "cuda" and adapter.weight_sync.extension is None and adapter.version is None
    assert adapter.model_path is None and adapter.sleep_mode is False and adapter.weight_version is None
    assert view.memory_saver == "off" and all(state.value == "resident" for state in view.tags.values())


class ContextViewEngine(OddViewEngine):
    def __init__(self, max_model_len: object) -> None:
        self.max_model_len = max_model_len

    async def call(self, method: str, path: str, body: object = None, **_: object) -> dict:
        if path.startswith("/server_info"):
            return {"vllm_config": {"model_config": {"model": "m", "max_model_len": self.max_model_len}}}
        return await super().call(method, path, body)


async def test_a_null_max_new_tokens_asks_vllm_for_its_whole_context() -> None:
    """SGLang's explicit null ``max_new_tokens`` is "up to the context": vLLM's ``max_model_len``, read with its
    view, where the translation had sent SGLang's default 128 (found by review)."""
    import json

    from node_sidecar.engines import vllm

    adapter = vllm.VllmEngine(ContextViewEngine(4096))
    await adapter.read_view()
    body = json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": None}}).encode()
    assert json.loads(adapter.generation_call("/generate", body, "").body)["max_tokens"] == 4096
    adapter = vllm.VllmEngine(ContextViewEngine("4096"))
    await adapter.read_view()
    with pytest.raises(Unsupported, match="max_model_len"):
        adapter.generation_call("/generate", body, "")


class RpcEngine:
    """vLLM's ``/collective_rpc`` answering scripted ``results`` (one per worker) for each extension method."""

    base_url = "http://127.0.0.1:9"

    def __init__(self, results: dict[str, list]) -> None:
        self.results = results
        self.methods: list[str] = []

    async def call(self, method: str, path: str, body: dict | None = None, **_: object) -> dict:
        assert path == "/collective_rpc" and body is not None
        self.methods.append(body["method"])
        return {"results": self.results[body["method"]]}


def synced(results: dict[str, list]) -> VllmWeightSync:
    sync = VllmWeightSync(RpcEngine(results), timeout_s=1)
    sync.extension = "node_sidecar.engines.vllm_worker_ext.HandoffWeightSync"
    return sync


DISTRIBUTED = {"group_name": "g", "names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
JOIN = {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
        "backend": "gloo"}


async def test_a_failure_on_any_worker_is_not_a_success() -> None:
    """Only ``results[0]`` was read: with several workers (tensor parallel), worker 1 refusing or failing its load
    while worker 0 loaded was answered success (found by review). Now any failure raises, and an update that loaded
    on some workers but not others is WeightsLost (shards of two versions)."""
    from node_sidecar.engines.vllm_weights import WeightsLost
    from node_sidecar.errors import EngineRefused

    ok = {"ok": True, "loaded": 1, "complete": True}
    refused = {"ok": False, "error": "invalid_request", "message": "w: shape [1] does not match the model's [2]"}
    sync = synced({"handoff_update_from_distributed": [ok, refused]})
    with pytest.raises(WeightsLost) as lost:
        await sync.update("/update_weights_from_distributed", DISTRIBUTED, epoch="e")
    assert lost.value.status == 400 and "worker 1 of 2" in lost.value.message
    sync = synced({"handoff_update_from_distributed": [refused, refused]})
    with pytest.raises(EngineRefused) as both:
        await sync.update("/update_weights_from_distributed", DISTRIBUTED, epoch="e")
    assert not isinstance(both.value, WeightsLost) and both.value.type == "invalid_request"
    sync = synced({"handoff_update_from_distributed": [ok, {**ok, "complete": False}]})
    answer = await sync.update("/update_weights_from_distributed", DISTRIBUTED, epoch="e")
    assert answer["success"] is True and answer["complete"] is False
    joined = {"ok": True, "state": "joined", "rank": 1, "world_size": 2}
    sync = synced({"handoff_join_group": [{"ok": True}, {"ok": True}],
                   "handoff_weight_group": [joined, {"ok": False, "error": "weight_sync_timeout", "message": "x"}]})
    with pytest.raises(EngineRefused) as join:
        await sync.group_call("/init_weights_update_group", JOIN)
    assert join.value.status == 504 and join.value.type == "weight_sync_timeout"


async def test_a_success_answer_missing_its_fields_is_a_clear_502() -> None:
    """An ``ok`` answer without ``loaded`` / ``state`` / ``message`` was a KeyError: a 500 (found by review). It
    and an answer that is no list of results are 502 ``upstream_error``: ``engine_failed`` is a 500 (a model step
    raised) wherever it is answered (docs/api.md), and was answered here with 502."""
    from node_sidecar.errors import EngineRefused

    for results, call, body in (
            ({"handoff_update_from_distributed": ["not an object"]}, "/update_weights_from_distributed", DISTRIBUTED),
            ({"handoff_update_from_distributed": [{"ok": True}]}, "/update_weights_from_distributed", DISTRIBUTED),
            ({"handoff_join_group": [{"ok": True}], "handoff_weight_group": [{"ok": True}]},
             "/init_weights_update_group", JOIN),
            ({"handoff_leave_group": [{"ok": True}]}, "/destroy_weights_update_group", {"group_name": "g"})):
        sync = synced(results)
        with pytest.raises(EngineRefused) as refused:
            if call in ("/init_weights_update_group", "/destroy_weights_update_group"):
                await sync.group_call(call, body)
            else:
                await sync.update(call, body, epoch="e")
        assert (refused.value.status, refused.value.type) == (502, "upstream_error")


async def test_a_join_timeout_is_the_answer_even_when_abandoning_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The abandon after a join's timeout raised its own error in place of the 504 (found by review)."""
    from node_sidecar.engines import vllm_weights
    from node_sidecar.errors import EngineRefused

    monkeypatch.setattr(vllm_weights, "POLL_S", 0.01)
    sync = synced({"handoff_join_group": [{"ok": True}], "handoff_weight_group": [{"ok": True, "state": "joining"}],
                   "handoff_leave_group": [{"ok": False, "error": "engine_failed", "message": "gone"}]})
    sync.timeout_s = -4.9  # the poll's deadline (timeout + 5s) is already past
    with pytest.raises(EngineRefused) as timed_out:
        await sync.group_call("/init_weights_update_group", JOIN)
    assert timed_out.value.status == 504 and "abandoning the join failed too" in timed_out.value.message


def test_a_load_failing_with_any_exception_reports_the_weights_lost(tmp_path: Path) -> None:
    """Only RuntimeError/ValueError/KeyError/AssertionError were caught: a TypeError part way through vLLM's load
    escaped the extension (vLLM answers 500) and the sidecar kept the half-loaded weights as valid (found by
    review)."""
    arch = builtin_arch("builtin:tiny")
    weights = builtin_weights(arch, 0)
    save_checkpoint(tmp_path, arch, weights)

    class Failing(Worker):
        def reload_weights(self, *, weights_iterator, is_checkpoint_format: bool) -> None:
            next(weights_iterator)
            raise TypeError("unexpected keyword")

    answer = Failing(tmp_path)._handoff_load(list(weights.items()), "e")
    assert answer["ok"] is False and answer["weights_lost"] is True and "unexpected keyword" in answer["message"]


def test_buckets_are_complete_together_and_a_new_epoch_counts_afresh(tmp_path: Path) -> None:
    """``complete`` was true only for one update holding every tensor: a trainer's buckets after a level-2 sleep
    never made the weights valid again, and after a restart of vLLM its first bucket lifted ``weights_stale`` (the
    sidecar was told nothing) while the rest of the start checkpoint still served. Now the worker counts what the
    loads since the sidecar's epoch wrote; the sidecar begins a new epoch whenever the weights are lost."""
    arch = builtin_arch("builtin:tiny")
    weights = builtin_weights(arch, 0)
    save_checkpoint(tmp_path, arch, weights)
    worker = Worker(tmp_path)
    layer_0 = [(n, t) for n, t in weights.items() if n.startswith("model.layers.0.")]
    rest = [(n, t) for n, t in weights.items() if not n.startswith("model.layers.0.")]
    assert worker._handoff_load(layer_0, "a")["complete"] is False
    assert worker._handoff_load(rest, "a")["complete"] is True
    assert worker._handoff_load(rest, "b")["complete"] is False  # lost since: layer 0 must be written again
    assert worker._handoff_load(layer_0, "b")["complete"] is True


class SleepingEngine(RpcEngine):
    """vLLM asleep: ``/collective_rpc`` scripted as in :class:`RpcEngine`, the other endpoints answered and logged
    (``paths``) in their order with the extension's methods."""

    def __init__(self, results: dict[str, list]) -> None:
        super().__init__(results)
        self.paths: list[str] = []

    async def call(self, method: str, path: str, body: dict | None = None, **kwargs: object) -> dict:
        if path == "/collective_rpc":
            self.paths.append(body["method"] if body else path)
            return await super().call(method, path, body, **kwargs)
        self.paths.append(path.partition("?")[0])
        return {"success": True}


def asleep(results: dict[str, list], level: int):
    from node_sidecar.engines import vllm

    adapter = vllm.VllmEngine(SleepingEngine(results))
    adapter.weight_sync.extension = "node_sidecar.engines.vllm_worker_ext.HandoffWeightSync"
    adapter.released, adapter.level = {"weights", "kv_cache"}, level
    return adapter


TENSOR_PUSH = {"serialized_named_tensors": ["eA=="]}


async def test_a_refused_update_over_released_weights_leaves_them_asleep() -> None:
    """An update over released weights woke them before the worker checked it: a refused one (a wrong shape, part
    of a fused layer, a bad payload, ``selector: "draft"``) answered 400 with the weights resident (on a GPU, memory
    taken back from the trainer) while the node still counted them released, and lost after a level-2 sleep
    (found by review). Now the update is staged (received, checked) first and the weights woken only to load it."""
    from node_sidecar.errors import EngineRefused

    refused = {"ok": False, "error": "invalid_request", "message": "w: shape [1] does not match the model's [2]"}
    for path, body, method in (("/update_weights_from_tensor", TENSOR_PUSH, "handoff_update_from_tensor"),
                               ("/update_weights_from_distributed", DISTRIBUTED, "handoff_update_from_distributed")):
        for level in (1, 2):
            adapter = asleep({method: [refused], "handoff_drop_staged": [{"ok": True}]}, level)
            epoch = adapter.weights_epoch
            with pytest.raises(EngineRefused) as error:
                await adapter.weight_call(path, body)
            assert error.value.status == 400 and "resumed" not in error.value.extra
            assert "/wake_up" not in adapter.engine.paths, adapter.engine.paths
            assert adapter.released == {"weights", "kv_cache"} and adapter.level == level
            assert adapter.weights_discarded is False and adapter.weights_epoch == epoch
    adapter = asleep({}, 2)
    with pytest.raises(InvalidRequest, match="no draft model"):
        await adapter.weight_call("/update_weights_from_tensor", {**TENSOR_PUSH, "selector": "draft"})
    assert adapter.engine.paths == [] and adapter.released == {"weights", "kv_cache"}


async def test_an_update_over_released_weights_wakes_them_only_to_load_and_says_so_if_it_fails() -> None:
    """Staged, woken, loaded, in that order; a failure after the wake carries ``resumed``."""
    from node_sidecar.errors import EngineRefused

    staged = {"ok": True, "staged": 1}
    adapter = asleep({"handoff_update_from_tensor": [staged],
                      "handoff_load_staged": [{"ok": True, "loaded": 1, "complete": False}]}, 2)
    answer = await adapter.weight_call("/update_weights_from_tensor", TENSOR_PUSH)
    assert adapter.engine.paths == ["handoff_update_from_tensor", "/wake_up", "handoff_load_staged"]
    assert answer["resumed"] == ["weights"] and answer["weights_valid"] is False
    assert adapter.released == {"kv_cache"} and adapter.level == 0
    failed = {"ok": False, "error": "conflict", "message": "no update is staged"}
    adapter = asleep({"handoff_update_from_tensor": [staged], "handoff_load_staged": [failed]}, 1)
    with pytest.raises(EngineRefused) as error:
        await adapter.weight_call("/update_weights_from_tensor", TENSOR_PUSH)
    assert error.value.status == 409 and error.value.extra["resumed"] == ["weights"]


def test_a_staged_update_loads_only_when_asked(tmp_path: Path) -> None:
    """The worker's side of the above: ``stage`` decodes and checks, loads nothing; the load loads it once."""
    from handoff.weight_sync import serialize_named_tensors

    arch = builtin_arch("builtin:tiny")
    weights = builtin_weights(arch, 0)
    save_checkpoint(tmp_path, arch, weights)
    worker = Worker(tmp_path)
    payload = serialize_named_tensors(weights.items())
    assert worker.handoff_update_from_tensor([payload], stage=True) == {"ok": True, "staged": len(weights)}
    assert worker.loaded == []
    answer = worker.handoff_load_staged("e")
    assert answer["ok"] is True and answer["complete"] is True and worker.loaded == list(weights)
    assert worker.handoff_load_staged("e")["error"] == "conflict"  # loaded once; nothing staged now


class WorkerEngine(SleepingEngine):
    """vLLM asleep with a real worker extension behind ``/collective_rpc``; ``/wake_up`` waits for ``woken``."""

    def __init__(self, worker: Worker) -> None:
        super().__init__({})
        self.worker = worker
        self.woken = asyncio.Event()
        self.waking = asyncio.Event()

    async def call(self, method: str, path: str, body: dict | None = None, **kwargs: object) -> dict:
        if path == "/collective_rpc" and body is not None:
            self.paths.append(body["method"])
            return {"results": [getattr(self.worker, body["method"])(**body["kwargs"])]}
        self.paths.append(path.partition("?")[0])
        if path.startswith("/wake_up"):
            self.waking.set()
            await self.woken.wait()
        return {"success": True}


async def test_an_update_staged_over_sleeping_weights_is_dropped_when_its_caller_goes(tmp_path: Path) -> None:
    """An update over released weights is staged in the worker, then the weights are woken to load it. A caller
    gone (or any failure but a refusal) between the two left the staged tensors in the worker's memory, memory
    the sleep had given up (found by review). They are dropped on every way out now."""
    from handoff.weight_sync import serialize_named_tensors
    from node_sidecar.engines import vllm

    arch = builtin_arch("builtin:tiny")
    weights = builtin_weights(arch, 0)
    save_checkpoint(tmp_path, arch, weights)
    worker = Worker(tmp_path)
    adapter = vllm.VllmEngine(WorkerEngine(worker))
    adapter.weight_sync.extension = "node_sidecar.engines.vllm_worker_ext.HandoffWeightSync"
    adapter.released, adapter.level = {"weights", "kv_cache"}, 1
    body = {"serialized_named_tensors": [serialize_named_tensors(weights.items())]}
    push = asyncio.ensure_future(adapter.weight_call("/update_weights_from_tensor", body))
    await asyncio.wait_for(adapter.engine.waking.wait(), 10)
    assert worker._handoff_state()["staged"] is not None  # staged, waiting for the wake
    push.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(push, 5)
    assert worker._handoff_state()["staged"] is None and worker.loaded == []
    assert adapter.engine.paths == ["handoff_update_from_tensor", "/wake_up", "handoff_drop_staged"]


def test_a_name_of_megabytes_is_cut_in_the_extensions_refusal(tmp_path: Path) -> None:
    """A pushed or announced name the model lacks was quoted whole in the refusal (a 2 MB 400)."""
    arch = builtin_arch("builtin:tiny")
    weights = builtin_weights(arch, 0)
    save_checkpoint(tmp_path, arch, weights)
    problem = check(Worker(tmp_path), {"w" * 2_000_000: weights["model.norm.weight"]})
    assert problem is not None and "not a tensor of this model" in problem and len(problem) < 1000


@pytest.mark.timeout(30)
async def test_a_flush_is_bounded_by_what_is_left_of_its_deadline() -> None:
    """vLLM's ``/reset_prefix_cache`` was sent with ``--control-timeout`` whatever the caller's deadline (found by
    review): a flush given 0.5 s waited the whole 10 s on a vLLM that does not answer, and one whose deadline was
    spent (waiting behind another control call) was sent all the same. Now each reset is bounded by what is left,
    and none left is a 504 at once, nothing sent."""
    from node_sidecar.engines.vllm import VllmEngine
    from tests.node_sidecar.silent_engine import flush_deadlines

    took, late, connections = await flush_deadlines(VllmEngine, spent=(0,), late_s=0.5)
    assert late.extra["timeout_s"] <= 0.5 and took < 5, (late.extra, took)  # not the 10 s control timeout
    assert "/reset_prefix_cache" in late.message and connections == 1
