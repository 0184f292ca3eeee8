"""Small tokenizers of the kinds real models use, built offline, for detokenization tests: the built-in byte
tokenizer, a byte-level BPE whose tokens split multi-byte characters, and a Llama-2-style one with byte
fallback (a SentencePiece decoder that drops the leading space of a text's first token)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from node_engine.tokenizer import Tokenizer

BYTES = Tokenizer.builtin_bytes()
# the byte-fallback tokenizer's pieces, ids 259 on (0-2: <unk> <s> </s>, 3-258: <0x00>-<0xFF>)
FALLBACK_PIECES = ["▁", "▁Hello", "Hello", "a", "b", "▁a", "ab", "é", "你", "好"]
FALLBACK_IDS = {piece: 259 + n for n, piece in enumerate(FALLBACK_PIECES)}


def bpe(folder: Path) -> Tokenizer:
    """A byte-level BPE trained so that some tokens hold a character and part of the next one."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    pieces = ["A", "B", "ab", "xy", "€", "é", "你好", "世界", "😀", " ", "\n", "A€", "stop"]
    corpus = ["".join(rng.choice(pieces) for _ in range(30)) for _ in range(400)]
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<bos>", "<eos>", "<|sp|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _saved(hf, folder, "<bos>", "<eos>")


def byte_fallback(folder: Path) -> Tokenizer:
    """A Llama-2-style tokenizer: pieces, and ``<0xNN>`` tokens rendered by a byte-fallback decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update(FALLBACK_IDS)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    return _saved(hf, folder, "<s>", "</s>")


def _saved(hf: HFTokenizer, folder: Path, bos: str, eos: str) -> Tokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    return Tokenizer.from_folder(folder)


def all_kinds(folder: Path) -> dict[str, Tokenizer]:
    return {"bytes": BYTES, "bpe": bpe(folder / "bpe"), "byte_fallback": byte_fallback(folder / "fallback")}
