"""What a checkpoint folder holds besides its tensors (config.json, the tokenizer's files, generation_config.json,
the chat template), broken or hostile: one clear :class:`ModelConfigError` naming ``--model-path`` before anything
is allocated, never a traceback, an allocation of what the config claims, or a model that runs wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from node_engine.chat_template import MAX_RENDERED_CHARS, ChatTemplateError, render
from node_engine.config import EngineConfig
from node_engine.memory.saver import DisabledSaver
from node_engine.model.arch import ModelConfigError
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from node_engine.model.source import load_model_source
from node_engine.runner import ModelRunner

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    arch = builtin_arch("builtin:tiny", {"num_layers": 1})
    save_checkpoint(tmp_path, arch, builtin_weights(arch, seed=1))
    return tmp_path


def _edit_json(path: Path, **fields: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _start(folder: Path) -> ModelRunner:
    config = EngineConfig(model_path=str(folder))
    arch, _ = load_model_source(config)
    return ModelRunner(config, DisabledSaver(), arch)


@pytest.mark.parametrize("fields", [
    {"rope_theta": "NaN"}, {"rms_norm_eps": "nan"}, {"rope_theta": "inf"},
    {"rope_scaling": {**LLAMA3, "factor": "nan"}}, {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
    {"hidden_size": 128.5}, {"num_hidden_layers": True}, {"vocab_size": "320"}, {"tie_word_embeddings": "false"},
    {"hidden_act": "gelu"},
], ids=lambda fields: json.dumps(fields)[:60])
def test_config_values_the_model_cannot_run_with_are_refused(folder: Path, fields: dict[str, Any]) -> None:
    """Before: a NaN theta or epsilon (spelt as a string), a llama3 scaling with a NaN factor or no original
    context, ran and answered NaN logits; 128.5 was 128, true one layer, "false" tied embeddings; a gelu MLP
    ran as SiLU. All load."""
    _edit_json(folder / "config.json", **fields)
    with pytest.raises(ModelConfigError, match="--model-path"):
        _start(folder)


@pytest.mark.parametrize("nulls", [True, False], ids=["nulls", "float-size"])
def test_fields_published_configs_write_as_null_or_float_still_load(folder: Path, nulls: bool) -> None:
    """A null flag or size is the field's default and a whole float a size, as transformers reads them."""
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    fields = {"tie_word_embeddings": None, "attention_bias": None, "head_dim": None} if nulls else \
        {"hidden_size": float(hidden)}
    _edit_json(folder / "config.json", **fields)
    assert _start(folder).arch.hidden_size == hidden


@pytest.mark.parametrize("fields", [{"vocab_size": 2 ** 40}, {"num_hidden_layers": 10 ** 9},
                                    {"intermediate_size": 2 ** 45}])
def test_sizes_past_the_checkpoint_are_refused_before_allocating_them(folder: Path, fields: dict[str, Any]) -> None:
    """Before: the model of the config's size was allocated first (a RuntimeError from torch's allocator, a
    traceback at start; a billion layers built module by module until memory ran out)."""
    _edit_json(folder / "config.json", **fields)
    with pytest.raises(ModelConfigError, match="--model-path .*config.json"):
        load_model_source(EngineConfig(model_path=str(folder)))


@pytest.mark.parametrize("hidden_size,head_dim", [(128, 33), (12, None)], ids=["head_dim-33", "hidden-12-heads-4"])
def test_an_odd_head_size_is_refused_at_start(tmp_path: Path, hidden_size: int, head_dim: int | None) -> None:
    """Rotary embeddings rotate pairs of a head's values: an odd head size (given, or hidden_size over the heads)
    loaded, then failed every request with a shape error from the rotation ("tensor a (33) must match tensor b
    (34)"). Also through --model-override on a built-in model."""
    odd = head_dim if head_dim is not None else hidden_size // 4
    # the tensors of 4 heads (2 for keys and values) of an odd size are those of 2 (1) heads twice that size
    arch = builtin_arch("builtin:tiny", {"num_layers": 1, "hidden_size": hidden_size, "num_heads": 2,
                                         "num_kv_heads": 1, "head_dim": 2 * odd})
    save_checkpoint(tmp_path, arch, builtin_weights(arch, seed=1))
    _edit_json(tmp_path / "config.json", num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    with pytest.raises(ModelConfigError, match="--model-path .*head_dim .*even"):
        _start(tmp_path)
    with pytest.raises(ModelConfigError, match="--model-override: .*head_dim .*even"):
        load_model_source(EngineConfig(model_path="builtin:tiny", model_override='{"head_dim": 33}'))


def test_a_context_past_the_memory_is_a_start_error(folder: Path) -> None:
    """Before: max_position_embeddings 2^50 was a RuntimeError from allocating the rotary table."""
    _edit_json(folder / "config.json", max_position_embeddings=2 ** 50)
    with pytest.raises(ValueError, match="--model-path .*max_position_embeddings 1125899906842624: the rotary"):
        _start(folder)


@pytest.mark.parametrize("name,content", [
    ("generation_config.json", b"{not json"), ("generation_config.json", b"\xff\xfe"),
    ("tokenizer_config.json", b"[]"), ("tokenizer_config.json", b'{"chat_template": 5}'),
    ("generation_config.json", b'{"eos_token_id": [257, 100000]}'),
])
def test_broken_tokenizer_files_are_a_start_error(folder: Path, name: str, content: bytes) -> None:
    """Before: a JSONDecodeError, UnicodeDecodeError or AttributeError traceback at start, or a chat
    template of 5 that failed every chat request with a 500, or a stop token past the logits that failed every
    step of a request with min_new_tokens."""
    (folder / name).write_bytes(content)
    with pytest.raises(ModelConfigError, match="--model-path"):
        load_model_source(EngineConfig(model_path=str(folder)))


def test_stop_tokens_of_the_wrong_type_are_left_out(folder: Path) -> None:
    """Before: an eos_token_id of 5.0 in generation_config.json was a TypeError traceback at start."""
    (folder / "generation_config.json").write_text('{"eos_token_id": [5.0, true, 257]}')
    assert load_model_source(EngineConfig(model_path=str(folder)))[1].eos_token_ids == (257,)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_file_that_never_ends_is_not_read(folder: Path, name: str) -> None:
    """A /proc file says it has 0 bytes and reads on (``pagemap``: hundreds of GB). Before: read to its end (in
    a process of 3 GB: a MemoryError, or the tokenizers library's "out of memory", after seconds)."""
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to("/proc/self/pagemap")
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
              "from node_engine.config import EngineConfig\nfrom node_engine.model.source import load_model_source\n"
              "from node_engine.model.arch import ModelConfigError\n"
              f"try:\n    load_model_source(EngineConfig(model_path={str(folder)!r}))\n"
              "except ModelConfigError as exc:\n    print('refused:', exc)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.startswith("refused: --model-path"), done.stdout + done.stderr[-2000:]


def test_a_fifo_config_is_named_as_such(folder: Path) -> None:
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    with pytest.raises(ModelConfigError, match="FIFO"):
        load_model_source(EngineConfig(model_path=str(folder)))


def test_a_template_that_renders_gigabytes_is_refused() -> None:
    """Before: rendered 10^10 pieces into one string (hundreds of GB) in the request's thread."""
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}0123456789{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=str(MAX_RENDERED_CHARS)):
        render(loop, [], add_generation_prompt=True, bos_token="", eos_token="")


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}", "{{ messages.__class__.__init__.__globals__ }}",
                                    "{{ raise_exception.__globals__.keys() }}", "{% set x = [].append(1) %}"])
def test_the_template_is_sandboxed(source: str) -> None:
    """As transformers' (the same ``ImmutableSandboxedEnvironment``): an unsafe attribute is an undefined value
    that raises when used, a list cannot be changed."""
    with pytest.raises(ChatTemplateError):
        render(source, [{"role": "user", "content": "hi"}], add_generation_prompt=True, bos_token="",
               eos_token="")
