"""``update_weights_from_tensor`` from this (test) process to a real engine process on the same host, and the
restricted unpickler that guards it."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch

from handoff.weight_sync import serialize_named_tensors
from node_engine.weight_sync.unpickler import UnsafePayload, restricted_loads
from tests.support.procs import ServerProcess
from tests.support.sglang_payloads import (FlattenedTensorMetadata, b64, flatten_bucket, flattened_payload, serialize,
                                         verl_payload)
from tests.support.weights import greedy, save_tiny, tiny_weights

@pytest.fixture(scope="module")
def new_weights() -> dict[str, torch.Tensor]:
    return tiny_weights(7)


@pytest.fixture(scope="module")
def engines(proc_log_dir: Path, tmp_path_factory: pytest.TempPathFactory, new_weights):
    """The engine pushed to (seed 0), and a reference loaded from a checkpoint of the new weights."""
    folder = save_tiny(tmp_path_factory.mktemp("new"), new_weights)
    pushed = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=proc_log_dir, name="pushed")
    reference = ServerProcess("node_engine", ["--model-path", str(folder)], log_dir=proc_log_dir, name="reference")
    pushed.start()
    reference.start()
    yield pushed, reference
    pushed.stop()
    reference.stop()


def push(url: str, payload: str, **fields) -> httpx.Response:
    return httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload], **fields},
                      timeout=60)


@pytest.fixture
def pushed(engines):
    """The pushed engine's URL; its seed-0 weights are back after each test."""
    url = engines[0].url
    yield url
    original = tiny_weights(0)
    assert push(url, serialize_named_tensors(original.items()), weight_version="default").status_code == 200


def test_a_full_push_serves_like_an_engine_loaded_from_the_checkpoint(engines, pushed, new_weights) -> None:
    before = greedy(pushed)
    r = push(pushed, serialize_named_tensors(new_weights.items()), weight_version="step-1")
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "step-1" and r.json()["weights_valid"] is True
    assert greedy(pushed) == greedy(engines[1].url) != before
    meta = httpx.post(pushed + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).json()
    assert meta["meta_info"]["weight_version"] == "step-1"


@pytest.mark.parametrize("form", ["verl", "flattened_bucket", "direct"])
def test_buckets_in_each_format_add_up_to_the_new_weights(engines, pushed, new_weights, form: str) -> None:
    names = list(new_weights)
    buckets = [names[: len(names) // 2], names[len(names) // 2:]]
    keep = []
    for i, bucket in enumerate(buckets):
        named = [(name, new_weights[name]) for name in bucket]
        fields: dict = {"flush_cache": i == len(buckets) - 1}
        if form == "verl":
            payload = verl_payload(named)
        elif form == "flattened_bucket":
            payload, buffer = flattened_payload(named)
            keep.append(buffer)
            fields["load_format"] = "flattened_bucket"
        else:  # SGLang's internal names: q/k/v and gate/up as the fused parameters
            payload, fields["load_format"] = serialize_named_tensors(_fuse(named)), "direct"
        r = push(pushed, payload, **fields)
        assert r.status_code == 200, r.text
    assert greedy(pushed) == greedy(engines[1].url)


def _fuse(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    by_name = dict(named)
    out = []
    for name, tensor in named:
        if name.endswith("q_proj.weight") and name.replace("q_proj", "v_proj") in by_name:
            parts = [by_name[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out.append((name.replace("q_proj", "qkv_proj"), torch.cat(parts)))
        elif name.endswith("gate_proj.weight") and name.replace("gate_proj", "up_proj") in by_name:
            out.append((name.replace("gate_proj", "gate_up_proj"),
                        torch.cat([tensor, by_name[name.replace("gate_proj", "up_proj")]])))
        elif not any(name.endswith(p) for p in ("k_proj.weight", "v_proj.weight", "up_proj.weight", "q_proj.weight",
                                                  "gate_proj.weight")):
            out.append((name, tensor))
    return out


@pytest.mark.parametrize("change", ["wrong shape", "unknown name", "integer dtype"])
def test_a_bad_bucket_is_400_and_nothing_of_it_is_loaded(pushed, new_weights, change: str) -> None:
    before = greedy(pushed)
    named = [(name, new_weights[name]) for name in list(new_weights)[:6]]
    name, tensor = named[-1]
    if change == "wrong shape":
        named[-1] = (name, tensor[:-1].clone())
    elif change == "unknown name":
        named[-1] = ("model.layers.0.mlp.extra.weight", tensor)
    else:
        named[-1] = (name, tensor.to(torch.int32))
    r = push(pushed, serialize_named_tensors(named), weight_version="bad")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert greedy(pushed) == before  # the five good tensors of the bucket were not loaded either
    assert httpx.get(pushed + "/get_weight_version").json()["weight_version"] == "default"


class _CreatesFile:
    def __init__(self, path: Path, how: str) -> None:
        self.path, self.how = path, how

    def __reduce__(self):
        if self.how == "open":
            return open, (str(self.path), "w")
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("how", ["open", "system"])
def test_a_pickle_that_would_create_a_file_is_400_and_runs_nothing(pushed, new_weights, tmp_path: Path,
                                                                   how: str) -> None:
    before = greedy(pushed)
    target = tmp_path / "created"
    evil = pickle.dumps([("model.norm.weight", new_weights["model.norm.weight"]), ("x", _CreatesFile(target, how))])
    with pytest.raises(UnsafePayload):
        restricted_loads(evil)
    # and nested where verl's format keeps each tensor: inside a LocalSerializedTensor
    nested = b64(serialize([("model.norm.weight", _Wrapped(evil))]))
    for payload in (b64(evil), nested):
        r = push(pushed, payload)
        assert r.status_code == 400, r.text
        assert "nothing was run" in r.json()["error"]["message"]
    assert not target.exists()
    assert greedy(pushed) == before


class _Wrapped:
    """A LocalSerializedTensor whose rank-0 bytes are ``data``."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        from tests.support.sglang_payloads import LocalSerializedTensor

        return LocalSerializedTensor, ([self.data],)


def test_garbage_payloads_are_400(pushed) -> None:
    for payload in ("not base64!", base64.b64encode(b"\x80\x04junk").decode(), b64(pickle.dumps({"a": 1}))):
        r = push(pushed, payload)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    # a tensor passed by file descriptor (torch's default sharing) cannot cross to an unrelated process
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler
    import io

    mp.set_sharing_strategy("file_descriptor")
    try:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump([("model.norm.weight", torch.ones(64))])
    finally:
        mp.set_sharing_strategy("file_system")
    r = push(pushed, b64(buffer.getvalue()))
    assert r.status_code == 400 and "file_system" in r.json()["error"]["message"], r.text


class _CalledMeta:
    """A FlattenedTensorMetadata built by calling its class (REDUCE), with fields of the wrong types."""

    def __reduce__(self) -> tuple:
        return FlattenedTensorMetadata, (["not a name"], (64,), torch.float32, 0.0, 256.0, 64)


@pytest.mark.parametrize("meta", [_CalledMeta(), FlattenedTensorMetadata("model.norm.weight", (2**63,), torch.float32,
                                                                         0, 256, 64)])
def test_bad_bucket_metadata_is_400_never_500(pushed, meta) -> None:
    before = greedy(pushed)
    buffer = torch.zeros(256, dtype=torch.uint8)
    r = push(pushed, b64(serialize({"flattened_tensor": buffer, "metadata": [meta]})), load_format="flattened_bucket")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert greedy(pushed) == before


class _NoRankBytes:
    """A LocalSerializedTensor with no bytes for any rank."""

    def __reduce__(self):
        from tests.support.sglang_payloads import LocalSerializedTensor

        return LocalSerializedTensor, ([],)


@pytest.mark.parametrize("where", ["unknown name", "not a tensor", "no bytes for the rank", "global"])
def test_a_name_of_megabytes_is_cut_in_the_answer(pushed, new_weights, where: str) -> None:
    """The tensor names of a push are the caller's to choose: a 2 MB unknown name was a 2 MB 400 (and log line),
    as a checkpoint's were before they were cut. Every name an answer quotes is cut, as a path is."""
    long_name = "w" * 2_000_000
    if where == "unknown name":
        payload = serialize_named_tensors([(long_name, new_weights["model.norm.weight"])])
    elif where == "not a tensor":
        payload = b64(serialize([(long_name, _Wrapped(pickle.dumps(3)))]))
    elif where == "no bytes for the rank":
        payload = b64(serialize([(long_name, _NoRankBytes())]))
    else:  # a pickle naming a global of its own (protocol 0's GLOBAL: module and name, one line each)
        payload = b64(b"c" + b"m" * 1_000_000 + b"\n" + b"n" * 1_000_000 + b"\n.")
    r = push(pushed, payload)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text[:300]
    assert len(r.content) < 2000, r.text[:300]


@pytest.mark.parametrize("change", ["entries missing", "entries overlap", "numel disagrees"])
def test_bucket_metadata_that_is_not_the_buffers_is_400(pushed, new_weights, change: str) -> None:
    """A flattened bucket's metadata that does not lay its tensors end to end over the whole buffer (SGLang's
    layout) was loaded as far as it went: a bucket that lost entries was a 200 and a partial update."""
    before = greedy(pushed)
    named = [(name, new_weights[name]) for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                                                    "model.layers.0.post_attention_layernorm.weight")]
    bucket = flatten_bucket(named)
    metadata = bucket["metadata"]
    if change == "entries missing":
        metadata = metadata[:2]
    elif change == "entries overlap":  # the third read from the second's bytes (the same size)
        third = metadata[2]
        metadata[2] = FlattenedTensorMetadata(third.name, third.shape, third.dtype, metadata[1].start_idx,
                                              metadata[1].end_idx, third.numel)
    else:
        metadata[0].numel += 4
    payload = b64(serialize({"flattened_tensor": bucket["flattened_tensor"], "metadata": metadata}))
    r = push(pushed, payload, load_format="flattened_bucket", weight_version="bad")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert greedy(pushed) == before
    assert httpx.get(pushed + "/get_weight_version").json()["weight_version"] == "default"


def test_an_entry_for_another_rank_that_is_no_payload_is_400(pushed, new_weights) -> None:
    """Only rank 0's entry was decoded: a second entry that is not base64 (SGLang decodes every one) was a 200."""
    before = greedy(pushed)
    good = serialize_named_tensors([("model.norm.weight", new_weights["model.norm.weight"])])
    r = httpx.post(pushed + "/update_weights_from_tensor", timeout=60,
                   json={"serialized_named_tensors": [good, "not base64!"], "weight_version": "bad"})
    assert r.status_code == 400 and "serialized_named_tensors[1]" in r.json()["error"]["message"], r.text
    assert greedy(pushed) == before
    assert httpx.get(pushed + "/get_weight_version").json()["weight_version"] == "default"


@pytest.mark.parametrize("load_format", ["pt", "gguf", "dummy"])
def test_a_disk_load_format_this_engine_cannot_read_is_400_unsupported(engines, load_format: str) -> None:
    """SGLang's other ``load_format`` values are valid fields this engine cannot do: SPEC's 400 ``unsupported``
    naming the field (as the vLLM adapter answers), not ``invalid_request``."""
    r = httpx.post(engines[0].url + "/update_weights_from_disk", json={"model_path": "/nonexistent",
                                                                       "load_format": load_format})
    assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported", r.text
    assert "load_format" in r.json()["error"]["message"]
