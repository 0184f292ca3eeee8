"""``--incremental-streaming-output``: each stream event carries only what is new, logprob lists included."""

from __future__ import annotations

import httpx
import pytest

from tests.support.procs import ServerProcess
from tests.support.sse import read_stream


@pytest.fixture(scope="module")
def client(proc_log_dir):
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--max-total-tokens", "1024",
                                         "--incremental-streaming-output"], log_dir=proc_log_dir)
    proc.start()
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        yield c
    proc.stop()


def test_incremental_events_add_up_to_the_whole_answer(client) -> None:
    body = {"text": "deltas", "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0}
    whole = client.post("/generate", json=body).json()
    events, saw_done = read_stream(client, "/generate", {**body, "stream": True})
    assert saw_done and len(events) > 2
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
    assert [x for e in events for x in e["meta_info"]["output_token_logprobs"]] == \
        whole["meta_info"]["output_token_logprobs"]
    assert all(len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"]) for e in events)
    assert events[-1]["meta_info"]["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
