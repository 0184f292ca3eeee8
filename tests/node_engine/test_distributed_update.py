"""``init_weights_update_group`` / ``update_weights_from_distributed`` / ``destroy_weights_update_group`` on a
real engine process, with this test process as the trainer (rank 0 of a gloo group, joined as SGLang's
``init_custom_process_group`` does)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from handoff.weight_sync import is_collective_timeout
from tests.support.procs import ServerProcess
from tests.support.trainer import Trainer, distributed_body, free_port
from tests.support.weights import greedy, save_tiny, tiny_weights

SYNC_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def weights() -> dict[str, dict[str, torch.Tensor]]:
    return {"old": tiny_weights(0), "new": tiny_weights(5)}


@pytest.fixture(scope="module")
def engines(proc_log_dir: Path, tmp_path_factory: pytest.TempPathFactory, weights):
    folder = save_tiny(tmp_path_factory.mktemp("new"), weights["new"])
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--weight-sync-timeout",
                                           str(SYNC_TIMEOUT_S)], log_dir=proc_log_dir, name="engine")
    reference = ServerProcess("node_engine", ["--model-path", str(folder)], log_dir=proc_log_dir, name="reference")
    try:
        for proc in (engine.launch(), reference.launch()):  # launched together: each loads while the other does
            proc.wait_ready()
        yield engine.url, reference.url
    finally:
        engine.stop()
        reference.stop()


def test_a_trainer_pushes_new_weights_and_they_serve_like_the_checkpoint(engines, weights) -> None:
    url, reference = engines
    before = greedy(url)
    trainer = Trainer(url)
    r = trainer.join()
    assert r.status_code == 200 and r.json()["rank"] == 1, r.text
    try:
        names = list(weights["new"])
        half = len(names) // 2
        r = trainer.push([(n, weights["new"][n]) for n in names[:half]], flush_cache=False)
        assert r.status_code == 200, r.text
        r = trainer.push([(n, weights["new"][n]) for n in names[half:]], flattened=True, weight_version="step-1")
        assert r.status_code == 200 and r.json()["weight_version"] == "step-1", r.text
        assert 0 < r.json()["receive_s"] <= r.json()["duration_s"]
        assert 0 < r.json()["commit_s"] < r.json()["duration_s"]
        assert greedy(url) == greedy(reference) != before
        # a wrong shape: 400, nothing loaded, and the broadcast was still taken so the group stays in step
        name = names[3]
        r = trainer.push([(name, weights["old"][name][..., :-1].contiguous())])
        assert r.status_code == 400 and "shape" in r.json()["error"]["message"], r.text
        assert greedy(url) == greedy(reference)
        r = trainer.push([(n, weights["old"][n]) for n in names], weight_version="default")
        assert r.status_code == 200, r.text
        assert greedy(url) == before
    finally:
        trainer.leave()
    r = httpx.post(url + "/destroy_weights_update_group", json={}, timeout=30)
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]


def test_a_trainer_that_never_joins_is_a_bounded_timeout(engines) -> None:
    url, _ = engines
    before = greedy(url)
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "nobody"}
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=httpx.post(url + "/init_weights_update_group",
                                                                        json=body, timeout=60)))
    started = time.monotonic()
    thread.start()
    while thread.is_alive() and time.monotonic() - started < SYNC_TIMEOUT_S - 1:
        # the engine keeps answering: a freeze holds a call for the whole 4 s wait, a loaded box has held one 2.1 s
        assert httpx.get(url + "/health", timeout=3).status_code == 200
    assert greedy(url) == before
    thread.join(30)
    assert answer["r"].status_code == 504 and answer["r"].json()["error"]["type"] == "weight_sync_timeout"
    assert SYNC_TIMEOUT_S <= time.monotonic() - started < SYNC_TIMEOUT_S + 10
    # the name is free again: the late join (if it ever completes) destroys what it made
    r = httpx.post(url + "/update_weights_from_distributed", json={"names": ["model.norm.weight"],
                                                                   "dtypes": ["float32"],
                                                                   "shapes": [[64]], "group_name": "nobody"})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]


def test_a_trainer_that_never_sends_breaks_the_group_clearly(engines, weights) -> None:
    url, _ = engines
    before = greedy(url)
    trainer = Trainer(url, group_name="silent")
    assert trainer.join().status_code == 200
    try:
        body = distributed_body([("model.norm.weight", torch.ones(64))], "silent")
        started = time.monotonic()
        r = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "weight_sync_timeout", r.text
        assert time.monotonic() - started < SYNC_TIMEOUT_S + 10
        assert greedy(url) == before
        r = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)
        assert r.status_code == 409 and r.json()["error"]["type"] == "weight_sync_broken", r.text
    finally:
        trainer.leave()


@pytest.mark.parametrize("error, is_timeout", [
    (torch.distributed.DistBackendError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3938ms for "
                                        "recv operation to complete"), True),
    (torch.distributed.DistBackendError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), False),
    (RuntimeError("Socket Timeout"), True),  # the store, when a rank never comes to a join
    (ValueError("timed out"), False),  # not a collective's error
])
def test_the_groups_own_timeout_is_a_timeout_not_a_broken_group(error: Exception, is_timeout: bool) -> None:
    """The group is joined with --weight-sync-timeout as its own timeout, so a silent trainer trips either clock
    first; a CI run under load once got gloo's (409 weight_sync_broken) where the engine's gives 504."""
    assert is_collective_timeout(error) is is_timeout


@pytest.mark.parametrize("path,body", [
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[2**63]]}),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                          "shapes": [[2**32, 2**32]]}),
    *[("/init_weights_update_group", {"master_address": address, "master_port": 29999, "rank_offset": 1,
                                      "world_size": 2, "backend": "gloo"})
      for address in ["[", "127.0.0.1/x?y", "1.2.3.4:5", "a b", "\u00fc.example", "fe80::1%eth0"]],
])
def test_bodies_torch_cannot_take_are_400_before_anything_runs(engines, path: str, body: dict) -> None:
    """Sizes past int64 and addresses no ``tcp://`` URL can hold were 500s from inside torch."""
    r = httpx.post(engines[0] + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


def test_a_world_size_past_any_deployment_is_400_before_anything_is_joined(engines) -> None:
    """A join allocates gloo's full mesh, about 1.4 KiB per rank, before any peer answers: world_size 10^6 took
    1.4 GB of the engine's memory for --weight-sync-timeout, and 2^31 - 1 (then accepted) terabytes, as soon as
    any store answered at the address given. Refused (400) before anything runs; the engine does not join."""
    url, _ = engines
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2**20,
            "group_name": "too-many-ranks", "backend": "gloo"}
    started = time.monotonic()
    r = httpx.post(url + "/init_weights_update_group", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert "world_size" in r.json()["error"]["message"] and time.monotonic() - started < SYNC_TIMEOUT_S


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.rotary_emb.inv_freq",
                                  "model.layers.123456.self_attn.rotary_emb.inv_freq"])
def test_names_the_model_drops_cannot_declare_unbounded_sizes(engines, name: str) -> None:
    """Rotary buffers (and a tied ``lm_head.weight``) are received and dropped, so they passed the check whatever
    their size: 2^40 floats were allocated (a 409 from the allocator, or 4 TiB taken). Refused before anything is
    allocated, like any body too large to receive and discard."""
    url, _ = engines
    trainer = Trainer(url, group_name="dropped")
    assert trainer.join().status_code == 200
    try:
        body = {"names": [name], "dtypes": ["float32"], "shapes": [[1 << 40]], "group_name": "dropped"}
        r = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
        assert "too large" in r.json()["error"]["message"]
    finally:
        trainer.leave()


def test_a_dropped_name_of_a_sane_size_is_still_received_and_dropped(engines) -> None:
    url, _ = engines
    trainer = Trainer(url, group_name="dropped-small")
    assert trainer.join().status_code == 200
    try:
        r = trainer.push([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)),
                          ("model.norm.weight", tiny_weights(0)["model.norm.weight"])])
        assert r.status_code == 200, r.text
    finally:
        trainer.leave()


def test_a_draft_update_on_an_engine_without_one_still_takes_the_broadcasts(engines) -> None:
    """``selector: "draft"`` on an engine without a draft model: refused, but only after taking the trainer's
    broadcasts (it sends them whatever the answer), so the group stays in step and the next update lands; refused
    before receiving, the trainer's broadcast waited for a receiver until the group's timeout."""
    url, _ = engines
    trainer = Trainer(url, group_name="draft-refused")
    assert trainer.join().status_code == 200
    norm = tiny_weights(0)["model.norm.weight"]
    try:
        r = trainer.push([("model.norm.weight", norm)], selector="draft")
        assert r.status_code == 400 and "no draft model" in r.json()["error"]["message"], r.text
        assert "received and discarded" in r.json()["error"]["message"]
        assert trainer.push([("model.norm.weight", norm)]).status_code == 200
    finally:
        trainer.leave()


def test_a_misaligned_flattened_bucket_is_400_and_the_group_stays_in_step(engines) -> None:
    """A flattened bucket whose tensor starts at a byte offset its dtype cannot be viewed at (a float16 of odd
    length, here a rotary buffer the model drops, before a float32) was found only while receiving: 409
    ``weight_sync_broken`` before any broadcast was taken, the trainer's broadcast blocked until the group's timeout
    and the group was lost. Refused like any other body the model cannot take: 400, the bucket received and
    discarded, the group usable."""
    url, _ = engines
    trainer = Trainer(url, group_name="misaligned")
    assert trainer.join().status_code == 200
    norm = tiny_weights(0)["model.norm.weight"]
    before = greedy(url)
    try:
        r = trainer.push([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(3, dtype=torch.float16)),
                          ("model.norm.weight", norm)], flattened=True)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
        assert "aligned" in r.json()["error"]["message"] and "received and discarded" in r.json()["error"]["message"]
        assert greedy(url) == before
        assert trainer.push([("model.norm.weight", norm)], flattened=True).status_code == 200
    finally:
        trainer.leave()


def test_an_announced_name_of_megabytes_is_cut_in_the_answer(engines) -> None:
    """An announced name is the trainer's to choose: a 2 MB unknown one was echoed whole in the 400 (and log
    line). It is cut as a path is; the broadcasts are still taken, the group stays in step."""
    url, _ = engines
    trainer = Trainer(url, group_name="long-names")
    assert trainer.join().status_code == 200
    norm = tiny_weights(0)["model.norm.weight"]
    long_name = "w" * 2_000_000
    try:
        r = trainer.push([(long_name, norm)])
        assert r.status_code == 400 and "unknown weight" in r.json()["error"]["message"], r.text[:300]
        assert len(r.content) < 2000, r.text[:300]
        assert trainer.push([("model.norm.weight", norm)]).status_code == 200
    finally:
        trainer.leave()



@pytest.mark.parametrize("announced", [
    {"names": ["model.norm.weight", "model.norm.weight"], "dtypes": ["float32"] * 2, "shapes": [[128]] * 2},
    {"names": ["model.norm.weight"], "dtypes": ["int8"], "shapes": [[128]]},
    {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "flush_cache": "soon"},
    {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "new_field": 1},
], ids=["name-twice", "int8", "bad-field", "unknown-field"])
def test_a_body_refused_as_read_still_has_its_broadcasts_taken(engines, announced) -> None:
    """A body refused as it was read (a name listed twice, which SGLang loads; a torch dtype no weight has; a
    field wrong or unknown) was a 400 that received nothing, while the trainer broadcasts whatever the answer: its
    broadcast blocked until the trainer's own group timeout (30 min in some frameworks), which then closed the group
    under both. Its broadcasts are now received and discarded, as for a body the model refuses: 400, nothing
    loaded, the group in step for the next update."""
    url, _ = engines
    trainer = Trainer(url, group_name="refused-body")
    assert trainer.join(timeout_s=SYNC_TIMEOUT_S).status_code == 200
    norm = tiny_weights(0)["model.norm.weight"]
    before = greedy(url)
    try:
        dtype = torch.int8 if announced["dtypes"] == ["int8"] else torch.float32
        sent = [("model.norm.weight", torch.zeros(128, dtype=dtype))] * len(announced["names"])
        started = time.monotonic()
        r = trainer.push(sent, body={**announced, "group_name": "refused-body"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
        assert "received and discarded" in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < SYNC_TIMEOUT_S
        assert greedy(url) == before
        r = trainer.push([("model.norm.weight", torch.linspace(-1, 1, 128))])
        assert r.status_code == 200, r.text
        assert greedy(url) != before
        assert trainer.push([("model.norm.weight", norm)], weight_version="x").status_code == 200
        assert greedy(url) == before
    finally:
        trainer.leave()


def test_a_body_whose_broadcasts_cannot_be_sized_marks_its_group_out_of_step(engines) -> None:
    """Lists of different lengths: what the trainer broadcasts is unknowable, so nothing can be received; the 400
    says the group is out of step and the next update is 409 ``weight_sync_broken`` at once (the 400 had said
    nothing of the group, which the trainer's broadcast, blocked until its own timeout, then closed)."""
    url, _ = engines
    trainer = Trainer(url, group_name="unsized")
    assert trainer.join().status_code == 200
    norm = tiny_weights(0)["model.norm.weight"]
    try:
        body = {"names": ["model.norm.weight"], "dtypes": ["float32", "float32"], "shapes": [[128]],
                "group_name": "unsized"}
        r = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=30)
        assert r.status_code == 400 and "out of step" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/update_weights_from_distributed", timeout=30,
                       json=distributed_body([("model.norm.weight", norm)], "unsized"))
        assert r.status_code == 409 and r.json()["error"]["type"] == "weight_sync_broken", r.text
    finally:
        trainer.leave()


def test_sglangs_dtype_aliases_are_the_dtypes_they_name(engines) -> None:
    """SGLang reads a dtype with ``getattr(torch, dtype)``, so ``half`` / ``float`` / ``double`` are dtypes there, and
    receives one broadcast per tensor for any ``load_format`` but ``flattened_bucket`` (``direct`` too); they were 400s
    here (and the trainer's broadcast blocked)."""
    url, _ = engines
    trainer = Trainer(url, group_name="aliases")
    assert trainer.join().status_code == 200
    norm = tiny_weights(0)["model.norm.weight"]
    try:
        for alias, dtype in (("half", torch.float16), ("float", torch.float32), ("double", torch.float64)):
            body = {**distributed_body([("model.norm.weight", norm)], "aliases"), "dtypes": [alias]}
            r = trainer.push([("model.norm.weight", norm.to(dtype))], body=body)
            assert r.status_code == 200, r.text
        r = trainer.push([("model.norm.weight", norm)], load_format="direct")
        assert r.status_code == 200, r.text
    finally:
        trainer.leave()
