"""``--state-file`` on real processes: a sidecar and its engine killed together (a pod's memory OOM, a node reboot
with the pod kept) and started again on the same ports meet the fresh engine as a sidecar that lived on would."""

from __future__ import annotations

import http.client
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from handoff.weight_sync import serialize_named_tensors
from tests.support.procs import ServerProcess, assert_refused_at_start, wait_until
from tests.support.trainer import Trainer, distributed_body
from tests.support.weights import greedy, tiny_weights

pytestmark = pytest.mark.timeout(180)

SHORT = {"text": "short", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


class Pair:
    """An engine and its sidecar with ``--state-file``; both restart on their first ports."""

    def __init__(self, log_dir: Path, name: str, state_file: Path, *, poll_s: float = 0.2) -> None:
        self.state_file = state_file
        self.engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver"],
                                    log_dir=log_dir, name=f"{name}-engine").start(timeout=60)
        self.sidecar = ServerProcess("node_sidecar", [
            "--engine-url", self.engine.url, "--engine-poll-interval", str(poll_s), "--state-file", str(state_file)],
            log_dir=log_dir, name=f"{name}-sidecar")
        self.start_sidecar()

    def start_sidecar(self) -> None:
        self.sidecar.start(timeout=60)
        wait_until(lambda: self.view()["tags"]["weights"]["state"] != "unknown", timeout=30,
                   what="the sidecar to read its engine")
        wait_until(self.state_file.exists, timeout=10, what="the engine met written")

    def kill_both(self) -> None:
        self.sidecar.kill()
        self.engine.kill()

    def start_both(self) -> None:
        self.engine.start(timeout=60)
        self.start_sidecar()

    def view(self) -> dict[str, Any]:
        return httpx.get(self.sidecar.url + "/memory_occupation", timeout=10).json()

    def engine_view(self) -> dict[str, Any]:
        return httpx.get(self.engine.url + "/memory_occupation", timeout=10).json()

    def last_log(self) -> str:
        """The sidecar's log since its last start."""
        return self.sidecar.log_path.read_text().rsplit("=== start #", 1)[-1]

    def stop(self) -> None:
        self.sidecar.stop()
        self.engine.stop()


@pytest.fixture
def pair(proc_log_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    (tmp_path / "state").mkdir()
    p = Pair(proc_log_dir, request.node.name[:40], tmp_path / "state" / "intent.json")
    yield p
    p.stop()


def refused(pair: Pair) -> dict[str, Any]:
    r = httpx.post(pair.sidecar.url + "/generate", json=SHORT, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    return r.json()["error"]


def test_a_sidecar_restarted_with_its_engine_releases_the_fresh_engine_again(pair: Pair) -> None:
    r = httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache", "workspace"], r.text
    instance = pair.engine_view()["engine_instance"]
    # the sidecar alone: the same engine process, nothing to do
    pair.sidecar.kill()
    pair.start_sidecar()
    assert pair.engine_view()["engine_instance"] == instance and "new process" not in pair.last_log()
    assert pair.view()["tags"]["kv_cache"]["state"] == "released" and refused(pair)["type"] == "node_released"
    # both: the fresh engine starts resident, and is released again before anything is admitted
    pair.kill_both()
    pair.engine.start(timeout=60)
    fresh = pair.engine_view()
    assert fresh["engine_instance"] != instance and fresh["tags"]["kv_cache"]["state"] == "resident"
    pair.start_sidecar()
    wait_until(lambda: pair.engine_view()["tags"]["kv_cache"]["state"] == "released", timeout=20,
               what="kv_cache released again")
    assert "the engine is a new process" in pair.last_log() and "again on the restarted engine" in pair.last_log()
    view = pair.view()
    assert view["serving"] is False and view["not_serving_reason"] == "node_released", view
    assert pair.engine_view()["tags"]["weights"]["state"] == "resident"  # as the cluster left it
    error = refused(pair)
    assert error["type"] == "node_released" and error["released"] == ["kv_cache", "workspace"]
    assert httpx.get(pair.sidecar.url + "/ready", timeout=10).status_code == 503
    # the cluster's resume ends it, and that too is kept
    r = httpx.post(pair.sidecar.url + "/resume_memory_occupation", json={}, timeout=30)
    assert r.status_code == 200 and r.json()["serving"] is True, r.text
    assert httpx.post(pair.sidecar.url + "/generate", json=SHORT, timeout=30).status_code == 200
    pair.kill_both()
    pair.start_both()
    wait_until(lambda: pair.view()["serving"], timeout=20, what="the node to serve")


def push_tensors(pair: Pair, seed: int, version: str) -> None:
    payload = serialize_named_tensors(tiny_weights(seed).items())
    r = httpx.post(pair.sidecar.url + "/update_weights_from_tensor", timeout=60,
                   json={"serialized_named_tensors": [payload], "weight_version": version})
    assert r.status_code == 200, r.text


def test_a_sidecar_restarted_with_its_engine_after_an_update_holds_out_the_start_weights(pair: Pair) -> None:
    push_tensors(pair, 11, "step-1")
    updated = greedy(pair.sidecar.url)
    pair.kill_both()
    pair.start_both()
    view = pair.view()
    assert view["serving"] is False and view["not_serving_reason"] == "weights_stale", view
    assert view["weight_version"] == "default" and "'step-1'" in view["last_error"]
    error = refused(pair)
    assert error["type"] == "weights_stale" and "'default'" in error["message"] and "'step-1'" in error["message"]
    # held out across another restart of the sidecar alone, until the trainer's next update
    pair.sidecar.kill()
    pair.start_sidecar()
    assert pair.view()["not_serving_reason"] == "weights_stale"
    push_tensors(pair, 11, "step-2")
    assert pair.view()["serving"] is True and greedy(pair.sidecar.url) == updated


def test_an_update_that_woke_the_released_weights_is_not_undone_on_a_fresh_engine(pair: Pair) -> None:
    """The engine wakes released weights to load an update: the node serves them, and a fresh engine owes the
    cluster only the update, not a release of weights it holds resident now."""
    r = httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["weights"]}, timeout=30)
    assert r.status_code == 200, r.text
    push_tensors(pair, 11, "step-1")
    assert pair.view()["serving"] is True and '"released":[]' in pair.state_file.read_text()
    pair.kill_both()
    pair.start_both()
    assert pair.view()["not_serving_reason"] == "weights_stale"
    assert pair.engine_view()["tags"]["weights"]["state"] == "resident"
    push_tensors(pair, 11, "step-2")
    assert pair.view()["serving"] is True


def test_a_sidecar_restarted_alone_after_an_update_still_knows_the_weights_were_updated(pair: Pair) -> None:
    """Without the file it started knowing of no update, and served the next fresh engine's start weights."""
    push_tensors(pair, 11, "step-1")
    pair.sidecar.kill()
    pair.start_sidecar()
    assert pair.view()["serving"] is True  # the same engine: nothing to do
    pair.engine.kill()
    wait_until(lambda: pair.view()["engine_reachable"] is False, timeout=10, what="the engine seen down")
    pair.engine.start(timeout=60)
    wait_until(lambda: pair.view()["engine_reachable"] and pair.view()["tags"]["weights"]["state"] != "unknown",
               timeout=30, what="the fresh engine read")
    assert pair.view()["not_serving_reason"] == "weights_stale"
    push_tensors(pair, 11, "step-2")
    assert pair.view()["serving"] is True


def test_a_corrupt_state_file_is_a_warning_and_a_fresh_start(pair: Pair) -> None:
    assert httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["kv_cache"]},
                      timeout=30).status_code == 200
    assert httpx.post(pair.sidecar.url + "/resume_memory_occupation", json={}, timeout=30).status_code == 200
    pair.kill_both()
    pair.state_file.write_text('{"format": 1, "released": ["kv_cache"')  # cut short
    pair.start_both()
    line = next(line for line in pair.last_log().splitlines() if "is not a stored intent" in line)
    assert "WARNING" in line and "not valid JSON" in line
    wait_until(lambda: pair.view()["serving"], timeout=20, what="the node to serve")
    assert pair.engine_view()["tags"]["kv_cache"]["state"] == "resident"
    # and the file is a stored intent again from the next change
    assert httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["weights"]},
                      timeout=30).status_code == 200
    assert '"released":["weights"]' in pair.state_file.read_text()


def test_a_release_the_file_missed_is_learnt_from_the_engine_and_kept_for_a_fresh_one(pair: Pair) -> None:
    """The release's write failed (a folder in the file's place: a full or read-only disk alike) and the sidecar
    restarted: it read no release, yet its engine holds ``kv_cache`` released. Before, a later engine restart came
    up fully resident and the node served it, taking back the memory the trainer holds."""
    pair.state_file.unlink()  # the engine process met, as written at start
    pair.state_file.mkdir()
    r = httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert r.status_code == 200, r.text
    assert "cannot be written" in pair.last_log()
    pair.sidecar.kill()
    pair.state_file.rmdir()
    pair.start_sidecar()
    assert pair.view()["not_serving_reason"] == "node_released"
    pair.engine.kill()
    wait_until(lambda: pair.view()["engine_reachable"] is False, timeout=10, what="the engine seen down")
    pair.engine.start(timeout=60)
    wait_until(lambda: pair.engine_view()["tags"]["kv_cache"]["state"] == "released", timeout=20,
               what="kv_cache released again on the fresh engine")
    assert pair.view()["not_serving_reason"] == "node_released" and refused(pair)["type"] == "node_released"


def test_a_state_file_that_is_a_link_is_written_through(pair: Pair, tmp_path: Path) -> None:
    """Before, the first write renamed a regular file over the link: the file it named kept an older intent (read
    back wherever the link is made again, a volume kept across pods say)."""
    pair.sidecar.kill()
    kept = tmp_path / "kept"
    kept.mkdir()
    pair.state_file.unlink(missing_ok=True)
    pair.state_file.symlink_to(kept / "intent.json")
    pair.start_sidecar()
    r = httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert r.status_code == 200, r.text
    assert pair.state_file.is_symlink(), "the link was replaced"
    assert '"released":["kv_cache","workspace"]' in (kept / "intent.json").read_text()


def test_two_sidecars_on_one_state_file_the_second_is_refused(pair: Pair) -> None:
    """Two writers of one file overwrite each other's intent (and shared one temporary file: a write could
    interleave with the other's into a file neither wrote)."""
    stderr = assert_refused_at_start(["node_sidecar", "--engine-url", pair.engine.url, "--port", "0",
                                      "--state-file", str(pair.state_file)], "--state-file")
    assert "another process" in stderr
    assert httpx.post(pair.sidecar.url + "/release_memory_occupation", json={"tags": ["kv_cache"]},
                      timeout=30).status_code == 200
    assert '"released":["kv_cache","workspace"]' in pair.state_file.read_text()


def test_an_update_over_a_group_lost_while_it_waited_for_the_lock_is_refused(proc_log_dir: Path,
                                                                              tmp_path: Path) -> None:
    """Two broadcast updates reach the sidecar before it noticed that its engine restarted (its monitor sleeps):
    the first goes to the fresh engine (nothing told the sidecar yet), which knows no such group, and the sidecar
    reads the fresh engine then, under the lock the second waits for. Before, the second had been checked for a
    lost group before it waited, and went to the fresh engine as well (its 400) instead of the 409 that tells the
    trainer to form the group again."""
    pair = Pair(proc_log_dir, "lost-group-race", tmp_path / "intent.json", poll_s=600)
    connections: list[http.client.HTTPConnection] = []
    try:
        trainer = Trainer(pair.sidecar.url)
        assert trainer.join().status_code == 200
        pair.engine.kill()
        pair.engine.start(timeout=60)
        os.kill(pair.engine.pid, signal.SIGSTOP)  # the first update waits on it, holding the lock
        body = json.dumps(distributed_body(list(tiny_weights(11).items()), trainer.group_name))
        for _ in range(2):
            connections.append(http.client.HTTPConnection("127.0.0.1", pair.sidecar.port, timeout=60))
            connections[-1].request("POST", "/update_weights_from_distributed", body=body,
                                    headers={"Content-Type": "application/json"})
            if len(connections) == 1:
                wait_until(lambda: httpx.get(pair.sidecar.url + "/ready", timeout=10).status_code == 503,
                           timeout=10, what="the first update to hold the lock")
        for _ in range(3):  # the second is read (and waits for the lock) while the sidecar answers these
            assert httpx.get(pair.sidecar.url + "/health", timeout=10).status_code == 200
        os.kill(pair.engine.pid, signal.SIGCONT)
        first, second = (c.getresponse() for c in connections)
        assert first.status == 400 and "does not exist" in first.read().decode()
        error = json.loads(second.read())["error"]
        assert second.status == 409 and error["type"] == "weight_sync_broken", error
        assert error["group_name"] == trainer.group_name and "destroy" in error["message"]
        assert trainer.leave().status_code == 200  # the lost group is forgotten; the node serves
        wait_until(lambda: pair.view()["serving"], timeout=20, what="the node to serve")
    finally:
        if pair.engine.is_running():
            os.kill(pair.engine.pid, signal.SIGCONT)
        for connection in connections:
            connection.close()
        pair.stop()


def test_an_update_the_file_missed_is_learnt_from_the_engine_and_a_fresh_one_is_held_out(pair: Pair) -> None:
    """The update's write failed (a folder in the file's place: a full or read-only disk alike; a sidecar killed
    mid-update the same) and the sidecar restarted: it read no update. Before, a later engine restart came up with
    its start checkpoint and the node served it; handoff's engine says its weights came from an update."""
    pair.state_file.unlink()
    pair.state_file.mkdir()
    push_tensors(pair, 11, "step-1")
    assert "cannot be written" in pair.last_log() and pair.engine_view()["weights_updated"] is True
    pair.sidecar.kill()
    pair.state_file.rmdir()
    pair.start_sidecar()
    assert pair.view()["serving"] is True  # the same engine: nothing to do
    pair.engine.kill()
    wait_until(lambda: pair.view()["engine_reachable"] is False, timeout=10, what="the engine seen down")
    pair.engine.start(timeout=60)
    assert pair.engine_view()["weights_updated"] is False
    wait_until(lambda: pair.view()["not_serving_reason"] == "weights_stale", timeout=20,
               what="the fresh engine held out")
    error = refused(pair)
    assert error["type"] == "weights_stale" and "'default'" in error["message"] and "'step-1'" in error["message"]
    push_tensors(pair, 11, "step-2")
    assert pair.view()["serving"] is True


def test_a_stalled_disk_stalls_no_more_than_the_call_that_changed_the_intent(pair: Pair) -> None:
    """The state file's write hangs (its temporary file a FIFO nobody reads: an open that does not return, as on a
    stalled network disk). Before, the write ran on the event loop: /health, generation and every other call
    waited with the release that made the change."""
    tmp = pair.state_file.with_name(f".{pair.state_file.name}.tmp")
    os.mkfifo(tmp)
    reader = None
    with ThreadPoolExecutor(1) as pool:
        release = pool.submit(httpx.post, pair.sidecar.url + "/release_memory_occupation",
                              json={"tags": ["kv_cache"]}, timeout=60)
        try:
            wait_until(lambda: pair.engine_view()["tags"]["kv_cache"]["state"] == "released", timeout=20,
                       what="the release done in the engine")
            assert not release.done()  # its answer waits for the disk ...
            assert httpx.get(pair.sidecar.url + "/health", timeout=5).status_code == 200  # ... and nothing else
            assert pair.view()["tags"]["kv_cache"]["state"] == "released"
        finally:
            reader = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK)  # the write goes on (and fails: a FIFO)
        r = release.result()
    os.close(reader)
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache", "workspace"], r.text
    wait_until(lambda: "cannot be written" in pair.last_log(), timeout=10, what="the failed write logged")
    tmp.unlink()
    r = httpx.post(pair.sidecar.url + "/resume_memory_occupation", json={}, timeout=30)
    assert r.status_code == 200, r.text
    assert pair.state_file.is_file() and '"released":[]' in pair.state_file.read_text()


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_a_pause_the_sidecar_made_holds_generation_across_its_restart(pair: Pair, mode: str) -> None:
    """A ``wait`` or ``abort`` pause lives in the sidecar (the engine knows nothing of it) and was in its memory
    only (found by review): a sidecar restarted under it served at once while the trainer took the node for paused
    (mid weight update, say). It is kept in the state file now: restarted alone or with its engine, the sidecar
    holds generation until the cluster's ``continue_generation``, and a restart after that serves."""
    paused = httpx.post(pair.sidecar.url + "/pause_generation", json={"mode": mode}, timeout=30)
    assert paused.status_code == 200, paused.text
    pair.sidecar.kill()
    pair.start_sidecar()
    view = pair.view()
    assert view["paused"] is True and view["serving"] is False and view["admission"] == "holding", view
    assert view["not_serving_reason"] == "generation_paused", view
    assert json.loads(pair.state_file.read_text())["paused"] is True
    pair.kill_both()  # a fresh engine: the cluster's pause is the node's, not the engine process's
    pair.start_both()
    assert pair.view()["paused"] is True and pair.view()["serving"] is False
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, pair.sidecar.url + "/generate", json=SHORT, timeout=60)
        wait_until(lambda: pair.view()["held"] == 1, timeout=20, what="the generation held")
        continued = httpx.post(pair.sidecar.url + "/continue_generation", json={}, timeout=30)
        assert continued.status_code == 200 and continued.json()["serving"] is True, continued.text
        assert held.result().status_code == 200
    assert json.loads(pair.state_file.read_text())["paused"] is False
    pair.sidecar.kill()
    pair.start_sidecar()
    assert pair.view()["paused"] is False and pair.view()["serving"] is True
