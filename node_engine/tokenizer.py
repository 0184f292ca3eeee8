"""Tokenization and chat templates (incremental detokenization is :mod:`node_engine.detokenizer`).

One class serves both Hugging Face folders (``tokenizer.json`` +
``tokenizer_config.json``) and the built-in model, whose byte-level tokenizer
is an ordinary ``tokenizers`` object (id = byte value, then ``<bos>``,
``<eos>``), so a saved built-in checkpoint is a normal HF folder.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from handoff.checkpoint.files import FileReader
from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_engine.chat_template import ChatTemplateError, content_format, render
from node_engine.model.arch import ModelConfigError
from node_engine.model.builtin import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE, VISION_SPECIAL_TOKENS

BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The built-in VL model's template: content parts as Qwen2-VL's template renders them (an image part is
# one placeholder, expanded to the image's tokens after tokenizing).
BUILTIN_VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


_GIL_FREE_ENCODE_CHARS = 16 * 1024
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024  # tokenizer.json: the largest published are tens of MB
MAX_TOKENIZER_CONFIG_BYTES = 64 * 1024 * 1024  # tokenizer_config.json (chat templates inline), the others
# What a model's generation_config.json may set for chat requests that leave it out (SGLang's
# ModelConfig.get_default_sampling_params)
SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# Added tokens SGLang 0.5.23 always stops on, whatever the model's files name as EOS (its
# utils/hf_transformers/common.py, _ADDITIONAL_STOP_TOKEN_TEXTS): Llama 3.1's <|eom_id|>, ...
ADDITIONAL_STOP_TOKEN_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


class Tokenizer:
    def __init__(self, hf: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None,
                 sampling_defaults: dict[str, float] | None = None) -> None:
        """``sampling_defaults``: what the model's ``generation_config.json`` sets of :data:`SAMPLING_DEFAULT_KEYS`
        (chat requests that leave them out use them, SGLang's ``--sampling-defaults model``).
        ``chat_template`` renders every chat, one given tools too: of named templates, the first listed (SGLang's
        ``TemplateManager._select_named_template`` sets it as the tokenizer's only template at start)."""
        self._hf = hf
        self.sampling_defaults = dict(sampling_defaults or {})
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._byte_fallback_ids = _byte_fallback_ids(hf)
        self._is_byte_level = _is_byte_level(hf)

    @classmethod
    def from_folder(cls, folder: Path, extra_eos_ids: tuple[int, ...] = ()) -> "Tokenizer":
        reader = FileReader()  # regular files only, each read to the size it had when opened, at most a limit
        missing = [name for name in ("tokenizer.json", "tokenizer_config.json") if not reader.exists(folder / name)]
        if missing:
            raise ModelConfigError(f"model folder {folder} is missing {', '.join(missing)}")
        text = _read_text(reader, folder / "tokenizer.json", MAX_TOKENIZER_BYTES)
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises its own exception type for bad files
            raise ModelConfigError(f"cannot load the tokenizer of {folder}: {str(exc)[:200]}") from exc
        config = _read_object(reader, folder / "tokenizer_config.json")
        bos = _token_content(config.get("bos_token"))
        eos = _token_content(config.get("eos_token"))
        eos_ids = set(extra_eos_ids)
        gen_config = folder / "generation_config.json"
        generation = _read_object(reader, gen_config) if reader.exists(gen_config) else {}
        value = generation.get("eos_token_id")
        eos_ids.update(v for v in (value if isinstance(value, list) else [value])
                       if isinstance(v, int) and not isinstance(v, bool))
        if eos is not None and hf.token_to_id(eos) is not None:
            eos_ids.add(hf.token_to_id(eos))
        eos_ids.update(token_id for token_id, added in hf.get_added_tokens_decoder().items()
                       if added.content in ADDITIONAL_STOP_TOKEN_TEXTS)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: SGLang renders every chat with the first one listed
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = next(iter(named.values()), None)
        if template is None and reader.exists(folder / "chat_template.jinja"):
            template = _read_text(reader, folder / "chat_template.jinja", MAX_TOKENIZER_CONFIG_BYTES)
        if template is not None and not isinstance(template, str):
            raise ModelConfigError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                                   f"named templates, got {type(template).__name__}")
        sampling_defaults = {key: generation[key] for key in SAMPLING_DEFAULT_KEYS
                             if isinstance(generation.get(key), (int, float)) and not isinstance(generation[key], bool)}
        return cls(hf, bos_token=bos, eos_token=eos, eos_token_ids=tuple(sorted(eos_ids)), chat_template=template,
                   sampling_defaults=sampling_defaults)

    @classmethod
    def builtin_bytes(cls, *, vision: bool = False) -> "Tokenizer":
        return cls(build_byte_tokenizer(vision=vision), bos_token="<bos>", eos_token="<eos>",
                   eos_token_ids=(BYTE_EOS_ID,),
                   chat_template=BUILTIN_VL_CHAT_TEMPLATE if vision else BUILTIN_CHAT_TEMPLATE)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            # encode_batch releases the GIL while it works; encode does not. A long prompt
            # tokenized in a worker thread must not freeze the event loop.
            return self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_byte_fallback(self, token_id: int) -> bool:
        """A byte-fallback token (``<0xE2>``, Llama-2-style vocabularies): the decoder renders a run of them as
        a whole, so text ending in one is not stable yet."""
        return token_id in self._byte_fallback_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprob ``bytes``), as SGLang 0.5.23 finds them
        (``entrypoints/openai/utils.py`` ``token_id_to_bytes``): of a byte-level BPE tokenizer, its piece mapped
        back through the byte alphabet, so a lone byte of a multi-byte character keeps its value; otherwise (a
        SentencePiece vocabulary, whose ``é`` the alphabet would read as the byte 0xE9, or a piece outside the
        alphabet) the token's decoded text in UTF-8."""
        piece = self._hf.id_to_token(token_id)
        alphabet = _unicode_to_byte()
        if self._is_byte_level and piece and all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render ``messages`` (see :mod:`node_engine.chat_template`) with ``tools`` and tokenize the text. A
        template that fails with the tools is given them once more as bare functions, as SGLang does (some
        templates, Mistral's, expect tools without the OpenAI wrapper); its second error is the request's."""
        template = self.chat_template
        if not template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions or /generate")

        def text_with(template_tools: list[dict[str, Any]] | None) -> str:
            return render(template, messages, add_generation_prompt=add_generation_prompt,
                          bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                          template_kwargs=template_kwargs, tools=template_tools)
        try:
            text = text_with(tools)
        except ChatTemplateError:
            if not tools:
                raise
            text = text_with([tool["function"] if "function" in tool else tool for tool in tools])
        return self.encode(text, add_special_tokens=False)

    def assistant_prefix_ids(self, prefix: str) -> list[int]:
        """The ids a continued final assistant message adds to the prompt (SGLang 0.5.23's
        ``_append_assistant_prefix_to_prompt_ids``): the text encoded with the tokenizer's special tokens, less a
        leading BOS (an EOS the tokenizer appends stays, as there)."""
        ids = self.encode(prefix)
        bos_id = self._hf.token_to_id(self.bos_token) if self.bos_token else None
        return ids[1:] if ids and bos_id is not None and ids[0] == bos_id else ids

    @property
    def content_format(self) -> str:
        """How the chat template takes a message's content parts: ``"openai"`` (a list) or ``"string"``."""
        return content_format(self.chat_template) if self.chat_template else "string"


def _read_text(reader: FileReader, path: Path, limit: int) -> str:
    try:
        return reader.read_small(path, limit).decode()
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path} is not UTF-8 text: {exc}") from None


def _read_object(reader: FileReader, path: Path) -> dict[str, Any]:
    try:
        value = loads_bounded(reader.read_small(path, MAX_TOKENIZER_CONFIG_BYTES))
    except PeerJSONError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: a printable character for every byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in _bytes_to_unicode().items()}


def build_byte_tokenizer(*, vision: bool = False) -> HFTokenizer:
    """Byte-level tokenizer of the built-in models: token id = byte value; with ``vision``, reserved ids
    258-261 are Qwen2-VL's vision tokens."""
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = {i: f"<reserved_{i - 258}>" for i in range(258, BYTE_VOCAB_SIZE)}
    if vision:
        names.update(VISION_SPECIAL_TOKENS)
    tok.add_special_tokens(["<bos>", "<eos>"] + [names[i] for i in range(258, BYTE_VOCAB_SIZE)])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BYTE_BOS_ID)])
    return tok


def write_byte_tokenizer(folder: Path, *, vision: bool = False) -> None:
    build_byte_tokenizer(vision=vision).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "chat_template": BUILTIN_VL_CHAT_TEMPLATE if vision else BUILTIN_CHAT_TEMPLATE,
    }, indent=2))


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _is_byte_level(hf: HFTokenizer) -> bool:
    """Whether the vocabulary is written in the GPT-2 byte alphabet, probed as SGLang 0.5.23 probes it
    (``entrypoints/openai/utils.py`` ``_is_byte_level_tokenizer``): a few pieces across the vocabulary, each
    wholly in the alphabet. A SentencePiece vocabulary has ``▁`` pieces, outside it."""
    alphabet = _unicode_to_byte()
    size = hf.get_vocab_size(with_added_tokens=True)
    for token_id in (0, 1, 2, 3, size // 2, size - 2):
        piece = hf.id_to_token(token_id) if 0 <= token_id < size else None
        if piece and any(ch not in alphabet for ch in piece):
            return False
    return True


def _byte_fallback_ids(hf: HFTokenizer) -> frozenset[int]:
    """The ids of ``<0xNN>`` tokens, when the decoder falls back to bytes (none otherwise)."""
    decoder = hf.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    return frozenset(token_id for token, token_id in hf.get_vocab(with_added_tokens=False).items()
                     if _BYTE_TOKEN.fullmatch(token))
