"""Release, resume and reload on real engine processes (CPU backend), SPEC section 2 / issue 3."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.support.procs import ServerProcess, tiny_engine, wait_until
from tests.support.sse import read_stream

ALL = ["weights", "kv_cache", "cuda_graph", "workspace"]
# A built-in model of a few hundred MB: ~361 MB of weights, 128 MB of KV.
BIG = json.dumps({"hidden_size": 1024, "intermediate_size": 2816, "num_layers": 8, "num_heads": 16,
                  "num_kv_heads": 4, "head_dim": 64})
PROMPTS = ["The first probe", "Another probe, longer than the first one", "x"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}


def greedy_outputs(client: httpx.Client) -> list[list[int]]:
    r = client.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def rss(proc: ServerProcess) -> int:
    return psutil.Process(proc.pid).memory_info().rss


@pytest.fixture(scope="module")
def big_engine(proc_log_dir: Path):
    """Saver on, no backup; free memory readable from an override file (the 507 path)."""
    override = proc_log_dir / "free_bytes"
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--model-override", BIG,
                                         "--enable-memory-saver", "--free-memory-override-file", str(override)],
                         log_dir=proc_log_dir, name="big_engine")
    proc.start(timeout=120)
    proc.override_file = override  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The big engine's initial weights, saved, to reload after a release without backup."""
    folder = tmp_path_factory.mktemp("big_ckpt")
    arch = builtin_arch("builtin:tiny", json.loads(BIG))
    save_checkpoint(folder, arch, builtin_weights(arch, seed=0))
    return folder


@pytest.fixture
def big(big_engine: ServerProcess, big_checkpoint: Path):
    with httpx.Client(base_url=big_engine.url, timeout=60) as c:
        yield c
        # every test leaves the engine resident, loaded and serving
        big_engine.override_file.unlink(missing_ok=True)  # type: ignore[attr-defined]
        assert c.post("/resume_memory_occupation", json={"tags": None}).status_code == 200
        if not c.get("/memory_occupation").json()["weights_valid"]:
            r = c.post("/update_weights_from_disk", json={"model_path": str(big_checkpoint),
                                                          "weight_version": "default"})
            assert r.status_code == 200, r.text


def test_release_frees_host_memory_and_resume_takes_it_back(big, big_engine) -> None:
    before = rss(big_engine)
    r = big.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert r.status_code == 200, r.text
    body = r.json()
    freed = sum(body["bytes_freed"].values())
    # the workspace follows kv_cache when a client (knowing SGLang's tags) does not name it
    assert body["released"] == ["weights", "kv_cache", "workspace"] and freed > 400 * 2**20
    after_release = rss(big_engine)
    assert before - after_release >= 0.9 * freed, (before, after_release, freed)
    # and no more: the engine was not holding freed pages it had never given back (packing parks weights)
    assert before - after_release <= 1.1 * freed, (before, after_release, freed)
    occupation = big.get("/memory_occupation").json()
    assert occupation["tags"]["weights"]["state"] == "released"
    r = big.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert r.status_code == 200, r.text
    assert r.json()["weights_valid"] is False  # no backup: contents are gone
    assert rss(big_engine) - after_release >= 0.9 * freed


def test_idempotent_release_and_resume(big) -> None:
    r = big.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json()["already_resident"] == ["kv_cache", "workspace"]
    assert r.json()["resumed"] == []
    first = big.post("/release_memory_occupation", json={"tags": ["kv_cache", "workspace"]}).json()
    second = big.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights_drafter"]}).json()
    assert first["released"] == ["kv_cache", "workspace"]
    assert second["already_released"] == ["kv_cache", "workspace"] and second["not_present"] == ["weights_drafter"]
    assert second["released"] == [] and second["bytes_freed"] == {}
    resumed = big.post("/resume_memory_occupation", json={"tags": None}).json()
    assert resumed["resumed"] == ["kv_cache", "workspace"]
    again = big.post("/resume_memory_occupation", json={}).json()
    assert again["resumed"] == [] and again["success"] is True


@pytest.mark.parametrize("body", [{"tags": ["weights", "gpu"]}, {"tags": "weights"}, {"tags": [1]},
                                  {"stage_to_cpu": "yes"}, {"bogus": 1}])
def test_bad_release_bodies_are_400_and_change_nothing(big, body) -> None:
    r = big.post("/release_memory_occupation", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"
    assert all(t["state"] == "resident" for t in big.get("/memory_occupation").json()["tags"].values())


def test_stage_to_cpu_without_backup_is_409(big) -> None:
    r = big.post("/release_memory_occupation", json={"tags": ["weights"], "stage_to_cpu": True})
    assert r.status_code == 409 and r.json()["error"]["type"] == "no_weights_backup"
    assert big.get("/memory_occupation").json()["tags"]["weights"]["state"] == "resident"


def test_resume_with_too_little_memory_is_507_and_changes_nothing(big, big_engine) -> None:
    big.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    big_engine.override_file.write_text("1000")  # type: ignore[attr-defined]
    r = big.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 507
    error = r.json()["error"]
    assert error["type"] == "insufficient_memory" and error["free_bytes"] == 1000
    assert error["needed_bytes"] > 128 * 2**20
    assert big.get("/memory_occupation").json()["tags"]["kv_cache"]["state"] == "released"
    big_engine.override_file.unlink()  # type: ignore[attr-defined]
    assert big.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["resumed"] == ["kv_cache", "workspace"]


def test_a_reload_while_the_weights_are_released_checks_free_memory_first(big, big_engine, big_checkpoint) -> None:
    """A reload resumes the released weights itself: 507 when they do not fit, nothing resumed or loaded."""
    assert big.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    big_engine.override_file.write_text("1000")  # type: ignore[attr-defined]
    r = big.post("/update_weights_from_disk", json={"model_path": str(big_checkpoint), "weight_version": "v507"})
    assert r.status_code == 507 and r.json()["error"]["type"] == "insufficient_memory", r.text
    occupation = big.get("/memory_occupation").json()
    assert occupation["tags"]["weights"]["state"] == "released" and occupation["weight_version"] != "v507"
    big_engine.override_file.unlink()  # type: ignore[attr-defined]
    r = big.post("/update_weights_from_disk", json={"model_path": str(big_checkpoint), "weight_version": "v507"})
    assert r.status_code == 200 and r.json()["resumed"] == ["weights"] and r.json()["weights_valid"] is True


def test_release_with_a_request_in_flight_is_409_and_the_request_completes(big, big_engine) -> None:
    result: dict = {}

    def stream() -> None:
        with httpx.Client(base_url=big_engine.url, timeout=60) as c:
            result["events"], result["done"] = read_stream(c, "/generate", {
                "text": "busy", "stream": True, "sampling_params": dict(GREEDY, max_new_tokens=60)})

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: big.get("/memory_occupation").json()["running_requests"] == 1, timeout=20)
    r = big.post("/release_memory_occupation", json={"tags": None})
    t.join(60)
    assert r.status_code == 409 and r.json()["error"]["type"] == "requests_in_flight"
    assert result["done"] and result["events"][-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(result["events"][-1]["output_ids"]) == 60


def test_without_backup_weights_must_be_reloaded(big, big_checkpoint: Path) -> None:
    expected = greedy_outputs(big)
    big.post("/release_memory_occupation", json={"tags": None})
    assert big.post("/generate", json={"text": "x"}).status_code == 503
    assert big.post("/resume_memory_occupation", json={"tags": None}).json()["weights_valid"] is False
    r = big.post("/generate", json={"text": "x"})
    # one status per refusal in every process: 503 + Retry-After, so a router sends the request elsewhere
    assert r.status_code == 503 and r.json()["error"]["type"] == "weights_not_loaded"
    assert r.headers["retry-after"] == "1"
    r = big.post("/update_weights_from_disk", json={"model_path": str(big_checkpoint), "weight_version": "v2"})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "v2"
    assert greedy_outputs(big) == expected
    meta = big.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert meta["weight_version"] == "v2"
    assert big.get("/memory_occupation").json()["weights_valid"] is True


def test_dry_run_checks_without_loading(big, big_checkpoint: Path, tmp_path: Path) -> None:
    arch = builtin_arch("builtin:tiny", json.loads(BIG))
    save_checkpoint(tmp_path / "other", arch, builtin_weights(arch, seed=9))
    expected = greedy_outputs(big)
    r = big.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "other"), "dry_run": True})
    assert r.status_code == 200 and r.json()["dry_run"] is True
    assert greedy_outputs(big) == expected  # nothing was loaded
    r = big.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "none"), "dry_run": True})
    assert r.status_code == 400
    # The check reads shapes, never the weights: it answers while they are released, and changes nothing.
    assert big.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    r = big.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "other"), "dry_run": True})
    assert r.status_code == 200 and r.json()["dry_run"] is True, r.text
    assert big.get("/memory_occupation").json()["tags"]["weights"]["state"] == "released"


def test_bad_reloads_are_400_and_keep_the_old_weights(big, tmp_path: Path) -> None:
    expected = greedy_outputs(big)
    r = big.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
    wrong = dict(json.loads(BIG), intermediate_size=2048)
    arch = builtin_arch("builtin:tiny", wrong)
    save_checkpoint(tmp_path / "wrong", arch, builtin_weights(arch, seed=5))
    r = big.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "wrong")})
    assert r.status_code == 400, r.text
    assert greedy_outputs(big) == expected
    assert big.get("/memory_occupation").json()["weights_valid"] is True


def test_100_cycles_do_not_leak(big, big_engine) -> None:
    def cycle() -> None:
        assert big.post("/release_memory_occupation", json={"tags": ["kv_cache", "workspace", "cuda_graph"]}
                        ).status_code == 200
        assert big.post("/resume_memory_occupation", json={"tags": None}).status_code == 200

    cycle()
    first = rss(big_engine)
    for _ in range(99):
        cycle()
    last = rss(big_engine)
    assert abs(last - first) <= 0.05 * first, (first, last)


@pytest.fixture(scope="module")
def backup_engine(proc_log_dir: Path):
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver",
                                         "--weights-backup", "disk", "--backup-dir", str(proc_log_dir / "backup")],
                         log_dir=proc_log_dir, name="backup_engine")
    proc.start()
    yield proc
    proc.stop()


def test_disk_backup_restores_weights_bit_for_bit(backup_engine) -> None:
    with httpx.Client(base_url=backup_engine.url, timeout=60) as c:
        expected = greedy_outputs(c)
        for stage in (None, True):
            body = {"tags": None} if stage is None else {"tags": None, "stage_to_cpu": True}
            released = c.post("/release_memory_occupation", json=body).json()
            assert released["released"] == ALL
            resumed = c.post("/resume_memory_occupation", json={"tags": None}).json()
            assert resumed["weights_valid"] is True
            assert greedy_outputs(c) == expected


@pytest.fixture(scope="module")
def plain_engine(proc_log_dir: Path):
    yield from tiny_engine(proc_log_dir, "plain_engine")


def test_saver_off_refuses_release_and_resume(plain_engine) -> None:
    with httpx.Client(base_url=plain_engine.url, timeout=30) as c:
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r = c.post(path, json={"tags": ["kv_cache"]})
            assert r.status_code == 409
            error = r.json()["error"]
            assert error["type"] == "memory_saver_disabled" and "--enable-memory-saver" in error["message"]
        assert all(t["state"] == "resident" for t in c.get("/memory_occupation").json()["tags"].values())


def test_packed_weights_cycle_through_a_backup_holding_them_once(proc_log_dir: Path) -> None:
    """The big model's projections are packed (oneDNN layout): a backup cycle gives back and takes
    back the weights' bytes, no more (parked plain weights must not linger in the heap)."""
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--model-override", BIG,
                                         "--enable-memory-saver", "--weights-backup", "disk",
                                         "--backup-dir", str(proc_log_dir / "big_backup")],
                         log_dir=proc_log_dir, name="big_backup_engine")
    proc.start(timeout=120)
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as c:
            expected = greedy_outputs(c)
            for _ in range(2):
                before = rss(proc)
                r = c.post("/release_memory_occupation", json={"tags": ["weights"]})
                assert r.status_code == 200, r.text
                freed = r.json()["bytes_freed"]["weights"]
                after_release = rss(proc)
                # parked plain weights lingering would leave the drop near 0 (and a resume holding them twice
                # would grow by 2x); a busy process's own heap moves by tens of MiB meanwhile (CI runs saw 0.88
                # of the freed bytes given back, and 0.89 taken back)
                assert 0.75 * freed <= before - after_release <= 1.1 * freed, (before, after_release, freed)
                assert c.post("/resume_memory_occupation", json={"tags": None}).json()["weights_valid"] is True
                assert 0.75 * freed <= rss(proc) - after_release <= 1.1 * freed, (after_release, rss(proc), freed)
                assert greedy_outputs(c) == expected
    finally:
        proc.stop()
