"""node_sidecar/intent_file.py: the cluster's intent kept in ``--state-file`` (real files, CPU only)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from node_sidecar.intent import MAX_GROUPS, ClusterIntent, TagRecord
from node_sidecar.intent_file import MAX_STATE_BYTES, IntentWriter, load_intent

WRITE_TIMEOUT_S = 10


def kept(path: Path) -> tuple[ClusterIntent, IntentWriter]:
    intent, writer = load_intent(path)
    assert writer is not None
    return intent, writer


def read_back(path: Path) -> ClusterIntent:
    """What a sidecar started now would read."""
    return kept(path)[0]


def test_every_change_is_written_and_read_back_by_the_next_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "intent.json"
    intent, writer = kept(path)
    assert intent == ClusterIntent() and not path.exists()  # missing: a fresh start, nothing written yet
    intent.meet_engine("a", served_version="default", had_version=None)
    intent.record_release(["kv_cache"], stage_to_cpu=False)
    assert writer.flush(WRITE_TIMEOUT_S) and json.loads(path.read_text())["released"] == ["kv_cache"]
    intent.record_weights_loaded("step-1")
    intent.record_joined("g")
    assert writer.flush(WRITE_TIMEOUT_S)
    again, writer = kept(path)
    assert again == intent and again.to_json() == json.loads(path.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".intent.json.lock", "intent.json"]  # no temporary file
    # the one read back keeps writing
    again.record_resume(["kv_cache"])
    assert writer.flush(WRITE_TIMEOUT_S) and read_back(path).released == set()


def test_the_tags_an_engine_holds_are_read_back_and_a_file_from_before_them_still_reads(tmp_path: Path) -> None:
    """``engine_memory`` (an SGLang adapter's record) came after the rest: a file written without it is the
    intent it holds, not a fresh start that would forget the cluster's releases."""
    path = tmp_path / "intent.json"
    intent, writer = kept(path)
    intent.record_release(["kv_cache"])
    intent.record_engine_memory(TagRecord("k", ("kv_cache",), ("weights",)))
    assert writer.flush(WRITE_TIMEOUT_S)
    assert read_back(path).engine_memory == TagRecord("k", ("kv_cache",), ("weights",))
    garbage = TagRecord("k", (), (), weights_garbage=True)
    intent.record_engine_memory(garbage)
    assert writer.flush(WRITE_TIMEOUT_S) and read_back(path).engine_memory == garbage
    held = TagRecord("k", ("kv_cache",), (), continue_held=False)  # a continue held back, torch_empty_cache false
    intent.record_engine_memory(held)
    assert writer.flush(WRITE_TIMEOUT_S) and read_back(path).engine_memory == held
    without = json.loads(path.read_text())
    del without["engine_memory"]["weights_garbage"]  # written before it: not garbage
    del without["engine_memory"]["continue_held"]  # written before it: no continue held
    without["engine_memory"]["released"] = []
    path.write_text(json.dumps(without))
    assert read_back(path).engine_memory == TagRecord("k")
    intent.record_paused(True)
    assert writer.flush(WRITE_TIMEOUT_S) and read_back(path).paused is True
    older = json.loads(path.read_text())
    del older["engine_memory"]
    del older["paused"]  # written before it: not paused
    path.write_text(json.dumps(older))
    again = read_back(path)
    assert again.released == {"kv_cache"} and again.engine_memory is None and again.paused is False


def test_an_unchanged_intent_is_not_written_again(tmp_path: Path) -> None:
    path = tmp_path / "intent.json"
    intent, writer = kept(path)
    intent.record_release(["kv_cache"])
    assert writer.flush(WRITE_TIMEOUT_S)
    written = path.stat().st_mtime_ns
    os.utime(path, ns=(0, 0))
    intent.record_release(["kv_cache"])  # changes nothing
    assert writer.flush(WRITE_TIMEOUT_S) and path.stat().st_mtime_ns == 0 != written


BAD_FILES = [
    pytest.param(b"{", "not valid JSON", id="cut-short"),
    pytest.param(b"", "not valid JSON", id="empty"),
    pytest.param(b"\xff\xfe", "not valid JSON", id="not-utf8"),
    pytest.param(b'{"format": NaN}', "not valid JSON", id="nan"),
    pytest.param(b'{"released": ["kv_cache"]}', "exactly the keys", id="another-shape"),
    pytest.param(b"[" * 100 + b"]" * 100, "nesting", id="deep"),
    pytest.param(json.dumps({**ClusterIntent().to_json(), "engine_memory": {"engine": "k", "released": ["gpu"],
                                                                          "in_doubt": []}}).encode(),
                 "a list of distinct tags", id="engine-memory-tag"),
    pytest.param(json.dumps({**ClusterIntent().to_json(), "engine_memory": {"engine": None, "released": [],
                                                                          "in_doubt": []}}).encode(),
                 "engine_memory.engine", id="engine-memory-no-engine"),
    pytest.param(json.dumps({**ClusterIntent().to_json(), "engine_memory": {
        "engine": "k", "released": [], "in_doubt": [], "weights_garbage": 1}}).encode(),
                 "engine_memory.weights_garbage", id="engine-memory-garbage-not-bool"),
    pytest.param(json.dumps({**ClusterIntent().to_json(), "engine_memory": {
        "engine": "k", "released": [], "in_doubt": [], "continue_held": 0}}).encode(),
                 "engine_memory.continue_held", id="engine-memory-continue-not-bool"),
    pytest.param(json.dumps({**ClusterIntent().to_json(), "paused": "yes"}).encode(), "paused", id="paused-not-bool"),
    pytest.param(json.dumps({**ClusterIntent().to_json(), "later": 1}).encode(), "exactly the keys", id="extra-key"),
    pytest.param(b" " * MAX_STATE_BYTES + b"{}", "over the", id="too-large"),
]


@pytest.mark.parametrize(("content", "why"), BAD_FILES)
def test_a_file_that_is_not_an_intent_is_a_warning_and_a_fresh_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str) -> None:
    path = tmp_path / "intent.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="node_sidecar.intent_file"):
        intent, writer = kept(path)
    assert intent == ClusterIntent()
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "is not a stored intent" in record.getMessage() and why in record.getMessage()
    intent.record_release(["weights"])  # the next change replaces it
    assert writer.flush(WRITE_TIMEOUT_S) and read_back(path).released == {"weights"}


def test_something_other_than_a_file_is_a_warning_and_a_fresh_start(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "intent.fifo"
    os.mkfifo(path)  # an open would block the start for good
    with caplog.at_level(logging.WARNING, logger="node_sidecar.intent_file"):
        assert read_back(path) == ClusterIntent()
    assert "cannot be read (not a regular file)" in caplog.text


def test_an_intent_past_the_bounds_keeps_only_the_engine_record(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Rather than an older intent read back after a restart: nothing, but the record of what SGLang holds
    released (removing it too, a restarted sidecar took SGLang's released tags for resident: a generation or a
    second release killed SGLang)."""
    path = tmp_path / "intent.json"
    intent, writer = kept(path)
    intent.meet_engine("a", served_version="default", had_version=None)
    intent.record_release(["kv_cache"])
    intent.record_engine_memory(TagRecord("a", ("kv_cache",), ("weights",)))
    assert writer.kept(WRITE_TIMEOUT_S)
    with caplog.at_level(logging.ERROR, logger="node_sidecar.intent_file"):
        for i in range(MAX_GROUPS + 1):
            intent.record_joined(f"group-{i}")
        assert not writer.kept(WRITE_TIMEOUT_S)  # not all of it is in the file
    assert "cannot be kept in --state-file" in caplog.text
    assert read_back(path) == ClusterIntent(engine="a", engine_memory=TagRecord("a", ("kv_cache",), ("weights",)))
    intent.record_left("group-0")  # back within the bounds: kept again
    assert writer.kept(WRITE_TIMEOUT_S) and read_back(path) == intent


def test_a_write_that_fails_is_an_error_and_the_node_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    intent, writer = kept(folder / "intent.json")
    intent.record_release(["kv_cache"])
    assert writer.flush(WRITE_TIMEOUT_S)
    (folder / "intent.json").unlink()
    (folder / ".intent.json.tmp").mkdir()  # the temporary file cannot be made
    with caplog.at_level(logging.ERROR, logger="node_sidecar.intent_file"):
        intent.record_release(["weights"])
        assert not writer.kept(WRITE_TIMEOUT_S)  # done, and failed: what a memory call is refused on
    assert intent.released == {"kv_cache", "weights"} and "cannot be written" in caplog.text
    (folder / ".intent.json.tmp").rmdir()
    intent.record_resume(["weights"])  # written again at the next change
    assert writer.kept(WRITE_TIMEOUT_S) and read_back(folder / "intent.json").released == {"kv_cache"}


def test_a_link_named_as_the_temporary_file_is_never_written_through(tmp_path: Path) -> None:
    """In a folder others can write (``--state-file /tmp/intent.json``), a link named as the temporary file had the
    write open it and truncate and overwrite the file it names with the intent (then renamed the link over the state
    file). The temporary file is now always made afresh, never opened through a link."""
    path = tmp_path / "intent.json"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the sidecar's")
    (tmp_path / ".intent.json.tmp").symlink_to(victim)
    intent, writer = kept(path)
    intent.record_release(["kv_cache"])
    assert writer.flush(WRITE_TIMEOUT_S)
    assert victim.read_bytes() == b"not the sidecar's"
    assert not path.is_symlink() and read_back(path).released == {"kv_cache"}


def test_a_hard_link_named_as_the_temporary_file_is_replaced_not_written(tmp_path: Path) -> None:
    """The same with a hard link to another file: it is replaced by a file of the sidecar's own."""
    path = tmp_path / "intent.json"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the sidecar's")
    os.link(victim, tmp_path / ".intent.json.tmp")
    intent, writer = kept(path)
    intent.record_release(["weights"])
    assert writer.flush(WRITE_TIMEOUT_S)
    assert victim.read_bytes() == b"not the sidecar's" and read_back(path).released == {"weights"}
