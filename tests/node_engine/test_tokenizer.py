from __future__ import annotations

import json
from pathlib import Path

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from node_engine.tokenizer import Tokenizer

TOK = Tokenizer.builtin_bytes()


def test_byte_tokenizer_round_trip() -> None:
    text = "héllo, wörld ✓"
    ids = TOK.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode())
    assert TOK.decode(ids) == text


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for token in ids:
        detok.add(token)
        if detok.matched_stop is not None:
            break
        deltas.append(detok.take_delta(is_final=False))
    detok.finish()
    deltas.append(detok.take_delta(is_final=True))
    return deltas


def test_multibyte_characters_are_released_whole() -> None:
    text = "a✓b€"
    deltas = _feed(IncrementalDetokenizer(TOK), list(text.encode()))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_leaked_in_a_stream() -> None:
    detok = IncrementalDetokenizer(TOK, ("STOP",))
    deltas = _feed(detok, list("abcSTOPdef".encode()))
    assert detok.matched_stop == "STOP"
    assert "".join(deltas) == "abc"
    assert not any("S" in d for d in deltas)


def test_chat_template_renders_messages() -> None:
    ids = TOK.apply_chat_template([{"role": "user", "content": "hi"}])
    assert TOK.decode(ids) == "<|user|>hi\n<|assistant|>"
    assert ids[0] == 256


def test_long_texts_encode_the_same_on_the_gil_free_path() -> None:
    text = "héllo wörld " * 4000  # over the threshold where encode_batch is used
    assert TOK.encode(text) == [256] + list(text.encode())


def test_lazy_detokenization_gives_the_same_text() -> None:
    ids = list("naïve ✓ done".encode()) + [257] + list("€".encode())[:2]  # ends inside a character
    eager, lazy = IncrementalDetokenizer(TOK), IncrementalDetokenizer(TOK, is_lazy=True)
    streamed = "".join(_feed(eager, ids))
    for token in ids:
        lazy.add(token)
    lazy.finish()
    assert lazy.take_delta(is_final=True) == streamed == eager.text


def test_named_chat_templates_render_every_chat_with_the_first_listed_as_sglang_does(tmp_path: Path) -> None:
    """A tokenizer with named templates (Hermes-2-Pro's, Command-R's: ``default`` and ``tool_use``): SGLang 0.5.23
    sets the first listed as the tokenizer's only template at start (``TemplateManager._select_named_template``, no
    ``--hf-chat-template-name``), so a chat given tools renders with it too. Before: ``tool_use`` for a chat given
    tools (transformers' choice, which SGLang's override never reaches), and ``default`` whatever its place."""
    arch = builtin_arch("builtin:tiny", {"num_layers": 1})
    save_checkpoint(tmp_path, arch, builtin_weights(arch, seed=1))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    default = {"name": "default", "template": "D:{% for m in messages %}{{ m.content }}{% endfor %}"}
    tool_use = {"name": "tool_use",
                "template": "T:{% if tools %}{{ tools | length }}{% endif %}:{% for m in messages %}{{ m.content }}"
                            "{% endfor %}"}
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for listed, rendered in (([default, tool_use], ("D:hi", "D:hi")), ([tool_use, default], ("T::hi", "T:1:hi"))):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=listed)))
        tok = Tokenizer.from_folder(tmp_path)
        assert (tok.decode(tok.apply_chat_template(messages)),
                tok.decode(tok.apply_chat_template(messages, tools=tools))) == rendered
