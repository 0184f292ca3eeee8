"""The engine's answer text against SGLang 0.5.23's own detokenization, by random cases (hypothesis).

:class:`SGLangRequest` is SGLang's path of one request's text, copied (pure Python) from its source: the
scheduler's finish check and what it sends (``managers/schedule_batch.py``, ``Req``; ``managers/scheduler_components/
output_streamer.py``, ``accept``), the detokenizer's incremental decode and stop trim (``managers/
detokenizer_manager.py``), and the tokenizer manager's text (``managers/tokenizer_manager.py``, ``append_text``).
It decodes with a transformers tokenizer loaded as SGLang loads it (``utils/hf_transformers/tokenizer.py:516``,
``clean_up_tokenization_spaces=False``). Outputs are tokenized text (so that characters are whole, split across
tokens where the tokenizer splits them) with special tokens among them, after a prompt of tokenized text;
stop strings are pieces of the output.

Compared: the non-stream answer (text, finish reason, matched stop, tokens kept), and that the engine's stream
adds up to it. SGLang's own stream is not the reference: it can differ from its non-stream answer (a
byte-fallback run it streamed per character, its first characters rendered again as U+FFFD once a later
byte is invalid) and can leak part of a stop string of multi-byte characters (the U+FFFD of a character not
complete yet hides the stop string's prefix from ``check_match_stop_str_prefix``, and
``find_printable_text`` sends a CJK character before it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Callable, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_engine.config import EngineConfig
from node_engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from node_engine.sampling import SamplingParams
from node_engine.tokenizer import Tokenizer, write_byte_tokenizer
from tests.node_engine.checkpoints import make_checkpoint
from tests.node_engine.engine_harness import running_engine
from tests.node_engine.tokenizer_kinds import FALLBACK_IDS, bpe, byte_fallback

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PIECES = ["A", "B", "a", "b", "ab", "xy", "€", "é", "你好", "世界", "😀", " ", "\n", "Hello", " Hello", ".",
          "!"]
SPECIALS = {"bytes": [256, 257, 258], "bpe": [0, 1, 2], "byte_fallback": [1, 2]}
Decode = Callable[[List[int], bool], str]

# -- SGLang 0.5.23, copied -----------------------------------------------------------------------------------

INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5  # schedule_batch.py:163
DEFAULT_FORCE_STREAM_INTERVAL = 50          # environ.py:688 (SGLANG_FORCE_STREAM_INTERVAL)


def _is_chinese_char(cp: int) -> bool:
    """sglang/utils.py (from transformers' generation/streamers.py)."""
    return ((0x4E00 <= cp <= 0x9FFF) or (0x3400 <= cp <= 0x4DBF) or (0x20000 <= cp <= 0x2A6DF)
            or (0x2A700 <= cp <= 0x2B73F) or (0x2B740 <= cp <= 0x2B81F) or (0x2B820 <= cp <= 0x2CEAF)
            or (0xF900 <= cp <= 0xFAFF) or (0x2F800 <= cp <= 0x2FA1F))


def find_printable_text(text: str) -> str:
    """sglang/utils.py, verbatim."""
    if text.endswith("\n"):
        return text
    elif len(text) > 0 and _is_chinese_char(ord(text[-1])):
        return text
    elif len(text) > 1 and _is_chinese_char(ord(text[-2])):
        return text[:-1]
    else:
        return text[: text.rfind(" ") + 1]


@dataclasses.dataclass
class DecodeStatus:
    """detokenizer_manager.py:77-101 (the chunk list folded into ``decoded_text``)."""
    decoded_text: str
    decode_ids: List[int]
    surr_offset: int
    read_offset: int
    sent_offset: int = 0


def trim_matched_stop(output: Any, finished_reason: dict | None, no_stop_trim: bool) -> Any:
    """detokenizer_manager.py:194-226 (no tool-call parser)."""
    if not finished_reason:
        return output
    matched = finished_reason.get("matched", None)
    if matched is None:
        return output
    if isinstance(matched, str) and isinstance(output, str):
        pos = output.find(matched)
        if pos == -1:
            return output
        end = pos + len(matched)
        return output[:end] if no_stop_trim else output[:pos]
    if isinstance(matched, int) and isinstance(output, list):
        if no_stop_trim:
            return output
        return output[:-1]
    return output


class SGLangRequest:
    """One request through SGLang's scheduler, detokenizer and tokenizer manager, a token per step."""

    def __init__(self, decode: Decode, encode: Callable[[str], list[int]], prompt_ids: list[int], *,
                 stop: list[str], stop_token_ids: list[int], eos_token_ids: set[int], ignore_eos: bool,
                 max_new_tokens: int, skip_special_tokens: bool, no_stop_trim: bool, stream: bool) -> None:
        self.decode = decode  # tokenizer.decode(ids, skip_special_tokens=...)
        self.origin_input_ids_unpadded = list(prompt_ids)
        self.stop_strs = list(stop)
        # sampling_params.py:345-352
        self.stop_str_max_len = max((len(encode(s)) for s in stop), default=0)
        self.stop_token_ids = {int(t) for t in stop_token_ids} or None  # sampling_params.py:201-205
        self.eos_token_ids = eos_token_ids
        self.ignore_eos = ignore_eos
        self.max_new_tokens = max_new_tokens
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.stream = stream
        self.output_ids: list[int] = []
        self.finished_reason: dict | None = None
        self.finished_len: int | None = None
        self.surr_offset: int | None = None
        self.read_offset: int | None = None
        self.send_token_offset = 0
        self.send_decode_id_offset = 0
        self.status: DecodeStatus | None = None
        self.text = ""

    def run(self, sampled: list[int]) -> "SGLangRequest":
        for token in sampled:
            self.output_ids.append(token)
            self.update_finish_state()
            self.accept()
            if self.finished_reason is not None:
                return self
        raise AssertionError("the request did not finish")

    # schedule_batch.py:1509-1513
    @property
    def output_ids_through_stop(self) -> list[int]:
        if self.finished_len is not None:
            return self.output_ids[: self.finished_len]
        return self.output_ids

    def init_incremental_detokenize(self) -> tuple[list[int], int]:
        """schedule_batch.py:1788-1806."""
        first_iter = self.surr_offset is None or self.read_offset is None
        output_ids = self.output_ids_through_stop
        if first_iter:
            self.read_offset = len(self.origin_input_ids_unpadded)
            self.surr_offset = max(self.read_offset - INIT_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
            self.surr_and_decode_ids = self.origin_input_ids_unpadded[self.surr_offset:] + output_ids
            self.cur_decode_ids_len = len(output_ids)
        else:
            self.surr_and_decode_ids.extend(output_ids[self.cur_decode_ids_len:])
            self.cur_decode_ids_len = len(output_ids)
        return self.surr_and_decode_ids, self.read_offset - self.surr_offset

    def tail_str(self) -> str:
        """schedule_batch.py:1808-1828 (one token per step, no stop regex); HF's decode shows special tokens."""
        if not self.stop_strs:
            return ""
        tail_len = min(self.stop_str_max_len + 1, len(self.output_ids))
        return self.decode(self.output_ids[-tail_len:], False)

    def check_match_stop_str_prefix(self) -> bool:
        """schedule_batch.py:1830-1854."""
        if not self.stop_strs:
            return False
        tail_str = self.tail_str()
        if not tail_str:
            return False
        for stop_str in self.stop_strs:
            if stop_str in tail_str:
                return True
            min_len = min(len(tail_str), len(stop_str))
            for i in range(1, min_len + 1):
                if tail_str[-i:] == stop_str[:i]:
                    return True
        return False

    def update_finish_state(self) -> None:
        """schedule_batch.py:2007-2043 with 1911-1931 (a stop string: finished_len is the whole output, as
        ``_locate_str_stop_finished_len`` gives for one new token) and 1856-1878 (a stop token)."""
        token_id = self.output_ids[-1]
        tail_str = self.tail_str()
        for stop_str in self.stop_strs:
            if stop_str in tail_str:
                self.finished_reason = {"type": "stop", "matched": stop_str}
                self.finished_len = len(self.output_ids)
                return
        if not self.ignore_eos and ((self.stop_token_ids and token_id in self.stop_token_ids)
                                    or token_id in self.eos_token_ids):
            self.finished_reason = {"type": "stop", "matched": token_id}
            self.finished_len = len(self.output_ids)
            return
        if len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = {"type": "length", "length": self.max_new_tokens}
            self.finished_len = self.max_new_tokens

    def accept(self) -> None:
        """output_streamer.py:444-517 (stream_interval 1), then the tokenizer manager's ``append_text``."""
        if self.finished_reason is not None:
            should_output = True
        elif self.stream:
            should_output = not self.check_match_stop_str_prefix()
        else:
            should_output = len(self.output_ids) % DEFAULT_FORCE_STREAM_INTERVAL == 0
        if not should_output:
            return
        self.send_token_offset = len(self.output_ids_through_stop)
        decode_ids, read_offset = self.init_incremental_detokenize()
        delta_ids = decode_ids[self.send_decode_id_offset:]
        self.send_decode_id_offset = len(decode_ids)
        self.text += self.detokenize(delta_ids, read_offset)

    def detokenize(self, delta_ids: list[int], read_offset: int) -> str:
        """detokenizer_manager.py:310-429, one row."""
        if self.status is None:
            s = self.status = DecodeStatus(decoded_text="", decode_ids=list(delta_ids), surr_offset=0,
                                           read_offset=read_offset)
        else:
            s = self.status
            s.decode_ids.extend(delta_ids)
        read_ids = trim_matched_stop(s.decode_ids[s.surr_offset:], self.finished_reason, self.no_stop_trim)
        surr_ids = s.decode_ids[s.surr_offset: s.read_offset]
        # _grouped_batch_decode: an empty span decodes to ""
        surr_text = self.decode(surr_ids, self.skip_special_tokens) if surr_ids else ""
        read_text = self.decode(read_ids, self.skip_special_tokens) if read_ids else ""
        new_text = read_text[len(surr_text):]
        if self.finished_reason is None:
            pending = s.sent_offset - len(s.decoded_text)
            if new_text and not new_text.endswith("�"):
                s.decoded_text += new_text
                s.surr_offset = s.read_offset
                s.read_offset = len(s.decode_ids)
                s.sent_offset = len(s.decoded_text)
                return new_text[pending:] if pending else new_text
            printable = find_printable_text(new_text)
            s.sent_offset = len(s.decoded_text) + len(printable)
            return printable[pending:] if pending else printable
        output_str = trim_matched_stop(s.decoded_text + new_text, self.finished_reason, self.no_stop_trim)
        incremental_output = output_str[s.sent_offset:]
        s.sent_offset = len(output_str)
        return incremental_output

    def answer(self) -> tuple[str, str, str | int | None, int]:
        reason = self.finished_reason or {}
        return self.text, reason.get("type"), reason.get("matched"), len(self.output_ids_through_stop)


# -- the engine's side -------------------------------------------------------------------------------------

def handoff(tokenizer: Tokenizer, prompt_ids: list[int], sampled: list[int], *, stop: list[str],
            stop_token_ids: list[int], ignore_eos: bool, max_new_tokens: int, skip_special_tokens: bool,
            no_stop_trim: bool, stream: bool) -> tuple[tuple[str, str, str | int | None, int], list[str]]:
    """(the answer, the stream's deltas) as ``Engine.submit`` and ``Scheduler._finish_check`` / ``finish`` drive
    a detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, tuple(stop), is_lazy=not stream and not stop,
                                   skip_special_tokens=skip_special_tokens, no_stop_trim=no_stop_trim,
                                   context=prompt_ids[-CONTEXT_TOKENS:])
    deltas: list[str] = []
    for n, token in enumerate(sampled, 1):
        detok.add(token)
        if detok.matched_stop is not None:
            reason, matched = "stop", detok.matched_stop
        elif not ignore_eos and (token in tokenizer.eos_token_ids or token in stop_token_ids):
            reason, matched = "stop", token
        elif n >= max_new_tokens:
            reason, matched = "length", None
        else:
            if stream:
                deltas.append(detok.take_delta(is_final=False))
            continue
        if detok.matched_stop is None:
            detok.finish(drop_last=isinstance(matched, int) and not no_stop_trim)
        deltas.append(detok.take_delta(is_final=True))
        return (detok.text, reason, matched, n), deltas
    raise AssertionError("the request did not finish")


# -- the cases ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, Any]]:
    """Each kind's tokenizer, and the same loaded by transformers as SGLang loads it."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tokenizers")
    write_byte_tokenizer(folder)
    ours = {"bytes": Tokenizer.from_folder(folder), "bpe": bpe(folder / "bpe"),
            "byte_fallback": byte_fallback(folder / "fallback")}
    files = {"bytes": folder, "bpe": folder / "bpe", "byte_fallback": folder / "fallback"}
    return {kind: (tok, PreTrainedTokenizerFast(tokenizer_file=str(files[kind] / "tokenizer.json"),
                                                clean_up_tokenization_spaces=False))
            for kind, tok in ours.items()}


def _text(data: st.DataObject, max_pieces: int) -> str:
    return "".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=max_pieces)))


@pytest.mark.parametrize("kind", ["bytes", "bpe", "byte_fallback"])
@SETTINGS
@given(data=st.data(), skip=st.booleans(), no_stop_trim=st.booleans(), ignore_eos=st.booleans(),
       stream=st.booleans(), bos=st.booleans())
def test_answers_are_sglangs(kinds, kind, data, skip, no_stop_trim, ignore_eos, stream, bos) -> None:
    tokenizer, hf = kinds[kind]
    prompt = tokenizer.encode(_text(data, 6), add_special_tokens=bos)
    sampled = tokenizer.encode(_text(data, 14) or "a", add_special_tokens=False)
    for special in data.draw(st.lists(st.sampled_from(SPECIALS[kind]), max_size=2)):
        sampled.insert(data.draw(st.integers(0, len(sampled))), special)
    shown = tokenizer.decode(sampled, skip_special_tokens=False).replace("\ufffd", "")
    pieces = st.builds(lambda a, n: shown[a:a + n], st.integers(0, max(0, len(shown) - 1)), st.integers(1, 5))
    stop = [s for s in data.draw(st.lists(st.one_of(pieces, st.just("zz")), max_size=3)) if s]
    stop_token_ids = data.draw(st.lists(st.sampled_from(sampled), max_size=1))
    case = dict(stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                max_new_tokens=data.draw(st.integers(1, len(sampled))), skip_special_tokens=skip,
                no_stop_trim=no_stop_trim, stream=stream)

    answer, deltas = handoff(tokenizer, prompt, sampled, **case)
    sglang = SGLangRequest(lambda ids, skip_special: hf.decode(ids, skip_special_tokens=skip_special),
                           lambda s: hf.encode(s, add_special_tokens=False), prompt,
                           eos_token_ids=set(tokenizer.eos_token_ids), **{**case, "stream": False}).run(sampled)
    assert answer == sglang.answer()
    assert "".join(deltas) == answer[0]


def test_the_first_token_reads_as_after_the_prompt(kinds) -> None:
    """Found by review: the output was decoded without the prompt before it, so a SentencePiece decoder
    (Llama-2, Mistral) dropped the leading space of its first token: ``▁Hello`` read ``Hello`` where SGLang
    (``init_incremental_detokenize``: the prompt's last 5 ids first) answers `` Hello``."""
    tokenizer, _ = kinds["byte_fallback"]
    prompt = tokenizer.encode("ab")
    hello = [FALLBACK_IDS["▁Hello"]]
    assert tokenizer.decode(hello) == "Hello"  # "▁Hello" alone: its space stripped
    for stream in (False, True):
        for stop in ([], ["zz"]):
            answer, deltas = handoff(tokenizer, prompt, hello + hello, stop=stop, stop_token_ids=[],
                                     ignore_eos=False, max_new_tokens=2, skip_special_tokens=True,
                                     no_stop_trim=False, stream=stream)
            assert answer[0] == "".join(deltas) == " Hello Hello"


def test_a_stop_string_hidden_in_a_byte_run_is_never_streamed(kinds) -> None:
    """Found by CI (an example of the property above): ``世界AA`` is one run of byte-fallback tokens, and the
    check's window, starting inside it, rendered it all as U+FFFD until a later token; the stream had handed
    ``界AA`` out meanwhile, so its answer kept the text past the stop string that the non-stream answer cut."""
    tokenizer, hf = kinds["byte_fallback"]
    sampled = [1] + tokenizer.encode("AAAab世界世界Hello世界AAaA", add_special_tokens=False)
    case = dict(stop=["界AA"], stop_token_ids=[], ignore_eos=False, max_new_tokens=len(sampled),
                skip_special_tokens=False, no_stop_trim=False)
    sglang = SGLangRequest(lambda ids, skip_special: hf.decode(ids, skip_special_tokens=skip_special),
                           lambda s: hf.encode(s, add_special_tokens=False), [],
                           eos_token_ids=set(tokenizer.eos_token_ids), **case, stream=False).run(sampled)
    assert sglang.answer()[:3] == ("<s> AAAab世界世界Hello世", "stop", "界AA")
    for stream in (False, True):
        answer, deltas = handoff(tokenizer, [], sampled, **case, stream=stream)
        assert answer == sglang.answer() and "".join(deltas) == answer[0], (stream, deltas)


async def test_an_engine_answer_reads_as_after_the_prompt(tmp_path: Path) -> None:
    """The same end to end: a Llama checkpoint with that tokenizer, its tokens forced by ``logit_bias``."""
    make_checkpoint(tmp_path, "llama-mha-tied")
    tokenizer = byte_fallback(tmp_path)  # replaces the checkpoint's tokenizer
    prompt = tokenizer.encode("ab")
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True,
                            logit_bias=((FALLBACK_IDS["▁Hello"], 100.0),))
    async with running_engine(EngineConfig(model_path=str(tmp_path), max_total_tokens=256)) as engine:
        for stream in (False, True):
            engine.gate.check(prompt, params, None)
            handle = engine.submit(prompt, params, stream=stream)
            outputs = [await asyncio.wait_for(handle.next(), timeout=60)]
            while not outputs[-1].is_final:
                outputs.append(await asyncio.wait_for(handle.next(), timeout=60))
            assert "".join(o.text_delta for o in outputs) == " Hello Hello Hello"
