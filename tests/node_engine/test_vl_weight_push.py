"""A vision-language model's weights pushed as a trainer holds them: transformers 5 keeps a Qwen2-VL's tensors
under ``model.language_model.`` and ``model.visual.`` in memory (its checkpoints use the published ``model.`` and
``visual.``), and an RL trainer pushes ``state_dict()``. The engine takes both spellings, as it does from disk."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest
import torch

from handoff.weight_sync import serialize_named_tensors
from node_engine.config import EngineConfig
from node_engine.model.arch import ModelConfigError
from node_engine.model.loader import by_checkpoint_key, check_named_tensors, is_dropped_key
from node_engine.model.source import load_model_source
from node_engine.vision.model import build_model
from tests.node_engine.vl_checkpoints import encoded, make_vl_checkpoint, random_image
from tests.support.procs import ServerProcess

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is in the picture?"
IMAGE = base64.b64encode(encoded(random_image(80, 110, seed=3))).decode()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, torch.nn.Module]]:
    """Qwen2-VL checkpoints of seeds 0 and 1, with the transformers models they were saved from."""
    out = {}
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"qwen2vl-{seed}")
        out[seed] = folder, make_vl_checkpoint(folder, "qwen2-vl", seed=seed)
    return out


@pytest.fixture(scope="module")
def engines(checkpoints, proc_log_dir: Path):
    """The engine pushed to (seed 0) and a reference loaded from seed 1's checkpoint."""
    procs = [ServerProcess("node_engine", ["--model-path", str(checkpoints[seed][0]), "--max-total-tokens", "2048",
                                           "--max-image-tokens", "64"], log_dir=proc_log_dir, name=f"vl-{seed}")
             for seed in (0, 1)]
    for proc in procs:
        proc.start()
    yield procs
    for proc in procs:
        proc.stop()


def answer(url: str) -> list[int]:
    r = httpx.post(url + "/generate", json={"text": PROMPT, "image_data": IMAGE, "sampling_params": GREEDY},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_a_pushed_state_dict_in_transformers_names_serves_like_its_checkpoint(checkpoints, engines) -> None:
    pushed, reference = (proc.url for proc in engines)
    before = answer(pushed)
    state = checkpoints[1][1].state_dict()
    assert any(name.startswith("model.language_model.") for name in state)  # the in-memory spelling
    assert any(name.startswith("model.visual.") for name in state)
    r = httpx.post(pushed + "/update_weights_from_tensor", timeout=60,
                   json={"serialized_named_tensors": [serialize_named_tensors(state.items())],
                         "weight_version": "step-1"})
    assert r.status_code == 200, r.text
    assert answer(pushed) == answer(reference) != before


@pytest.fixture(scope="module")
def vl_model(checkpoints):
    arch = load_model_source(EngineConfig(model_path=str(checkpoints[0][0])))[0]
    return build_model(arch, device=torch.device("meta"), dtype=torch.float32)


def test_both_spellings_are_checked_as_one_name(checkpoints, vl_model) -> None:
    """The check a distributed update makes on announced (meta) tensors: either spelling is the same weight,
    so one tensor under both is listed twice."""
    state = checkpoints[1][1].state_dict()
    announced = [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in state.items()]
    checked = check_named_tensors(vl_model, by_checkpoint_key(vl_model, announced))
    assert set(checked) == set(vl_model.hf_weight_map())
    name = "model.language_model.layers.0.self_attn.o_proj.weight"
    twice = announced + [(name.replace("model.language_model.", "model."), torch.empty(state[name].shape,
                                                                                      device="meta"))]
    with pytest.raises(ModelConfigError, match="listed twice"):
        check_named_tensors(vl_model, by_checkpoint_key(vl_model, twice))
    assert is_dropped_key(vl_model, "model.language_model.layers.1.self_attn.rotary_emb.inv_freq")
