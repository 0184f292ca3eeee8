"""Which tokens end a sequence, as SGLang 0.5.23 decides it: EOS of ``config.json``, ``generation_config.json``
and the tokenizer, plus the added tokens SGLang always stops on (``utils/hf_transformers/common.py``,
``_ADDITIONAL_STOP_TOKEN_TEXTS``: ``<|eom_id|>``, ...; ``schedule_batch.py`` ``_check_token_based_finish``)."""

from __future__ import annotations

import json

import httpx
import pytest

from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.support.procs import ServerProcess

EOM = 268  # an added token of the byte tokenizer (``<reserved_10>``), renamed ``<|eom_id|>`` below


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    """An engine on a checkpoint whose tokenizer has Llama 3.1's ``<|eom_id|>``, which neither its
    ``generation_config.json`` nor its ``tokenizer_config.json`` names (as Llama-3.1-8B, the base model)."""
    folder = tmp_path_factory.mktemp("eom")
    arch = builtin_arch("builtin:tiny", {"num_layers": 1})
    save_checkpoint(folder, arch, builtin_weights(arch, seed=1))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        if token["id"] == EOM:
            token["content"] = "<|eom_id|>"
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    proc = ServerProcess("node_engine", ["--model-path", str(folder)], log_dir=folder)
    proc.start()
    try:
        with httpx.Client(base_url=proc.url, timeout=30) as c:
            yield c
    finally:
        proc.stop()


def _generate(client: httpx.Client, **sampling: object) -> dict:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {
        "temperature": 0, "max_new_tokens": 4, "logit_bias": {str(EOM): 100.0}, **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_added_eom_token_ends_the_sequence_as_in_sglang(client) -> None:
    """Before: ``<|eom_id|>`` was an ordinary token here: the sequence ran on to its length (``[268] * 4``)."""
    answer = _generate(client)
    assert answer["output_ids"] == [EOM]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOM}
    assert answer["text"] == ""


def test_min_new_tokens_holds_the_eom_token_back_and_ignore_eos_runs_past_it(client) -> None:
    """SGLang's ``min_new_tokens`` masks it with the other stop tokens; ``ignore_eos`` ignores it."""
    held = _generate(client, min_new_tokens=2)
    assert held["output_ids"][:2] != [EOM, EOM] and EOM not in held["output_ids"][:2]
    assert held["output_ids"][2] == EOM and held["meta_info"]["finish_reason"]["matched"] == EOM
    ignored = _generate(client, ignore_eos=True)
    assert ignored["output_ids"] == [EOM] * 4 and ignored["meta_info"]["finish_reason"]["type"] == "length"
