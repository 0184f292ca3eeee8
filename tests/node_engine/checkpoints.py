"""Tiny Hugging Face checkpoints made with transformers, for reference checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import torch

from node_engine.tokenizer import write_byte_tokenizer
from tests.support.procs import ServerProcess

VOCAB = 320  # the byte tokenizer's size, so every checkpoint here has a usable tokenizer


def make_checkpoint(folder: Path, kind: str, *, seed: int = 0, shard: bool = True):
    """Save a random ``kind`` model (see ``KINDS``) to ``folder``; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=256, eos_token_id=257)
    if kind == "llama-gqa-untied-llama3":
        config = LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=50000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(config)
    elif kind == "llama-mha-tied":
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True))
    elif kind == "qwen2-gqa-tied-bias":
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True))
    elif kind == "qwen2-gqa-untied-bias":
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=1, tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "1GB")
    write_byte_tokenizer(folder)
    return model


KINDS = ("llama-gqa-untied-llama3", "llama-mha-tied", "qwen2-gqa-tied-bias", "qwen2-gqa-untied-bias")


def templated_engine(folder: Path, template: str, context_length: int, *,
                     generation_config: dict[str, Any] | None = None) -> ServerProcess:
    """A ``llama-mha-tied`` checkpoint in ``folder`` whose tokenizer's chat template is ``template`` (and whose
    ``generation_config.json`` is ``generation_config``, if given), served by an engine process started here
    (``--served-model-name tiny-llama``); the caller stops it."""
    make_checkpoint(folder, "llama-mha-tied", shard=False)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    proc = ServerProcess("node_engine", ["--model-path", str(folder), "--context-length", str(context_length),
                                         "--served-model-name", "tiny-llama"], log_dir=folder)
    proc.start()
    return proc


CHAT_USER = {"role": "user", "content": "hi"}


def post_chat(client: httpx.Client, **body: Any) -> httpx.Response:
    """A one-token chat completion of ``CHAT_USER`` (``body`` adds or overrides fields)."""
    return client.post("/v1/chat/completions", json={"messages": [CHAT_USER], "max_tokens": 1, **body})


def rendered_prompt(client: httpx.Client, **body: Any) -> str:
    """The prompt a templated engine rendered for the chat (byte-level ids are the text's bytes)."""
    r = post_chat(client, return_prompt_token_ids=True, **body)
    assert r.status_code == 200, r.text
    return bytes(r.json()["choices"][0]["prompt_token_ids"]).decode()
