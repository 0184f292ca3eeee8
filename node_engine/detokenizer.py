"""Token ids to text, one token at a time, and SGLang's stop strings.

**Text** is released only once it is stable: not the tail of an incomplete
UTF-8 sequence, and not inside a run of byte-fallback tokens (``<0xE2>``...: a
Llama-2-style decoder renders a run as a whole, so an invalid byte later in
the run changes how the earlier ones render). A request's text is therefore
the concatenation of its deltas and equals the tokenizer's own decode of the
prompt's last ids (``context``) and its ids, less the decode of those prompt
ids: a stream and a non-stream answer always agree. As in SGLang 0.5.23
(``Req.init_incremental_detokenize``, up to ``INIT_INCREMENTAL_DETOKENIZATION_OFFSET``
= 5 prompt ids), the prompt's end is the first token's context: a SentencePiece
decoder (Llama-2, Mistral) drops the leading space of a text's first token, so
an answer's ``▁Hello`` reads `` Hello`` after a prompt.

**Stop strings** are checked as SGLang 0.5.23 checks them
(``schedule_batch.py``, ``Req._check_str_based_finish``): after each token,
the end of the output is decoded with special tokens shown and an incomplete
character as U+FFFD, and the first stop string *of the request's list* found
there ends the request. The answer's text (decoded with the request's
``skip_special_tokens``) is cut at that string's first occurrence, or kept
with ``no_stop_trim``; a text that does not hold it (the string named a
special token the text skips) is left whole (``detokenizer_manager.py``,
``trim_matched_stop``). SGLang decodes the last (longest stop string in
tokens + 1) ids, which misses a stop string spread over more tokens than its
own encoding; handoff decodes enough ids to hold the longest stop string
before the newest token, so it finds every stop string SGLang finds and
those too.

A stream holds back only the end of the text that could begin a stop string
(SGLang holds an event back in that case: ``check_match_stop_str_prefix``),
and a whole stop string the check has not found yet (its window, started
inside a byte-fallback run, can render it as U+FFFD for a few tokens).
A sequence that ends on a stop token leaves that token's text out
(``finish(drop_last=True)``).
"""

from __future__ import annotations

from typing import Sequence

from node_engine.tokenizer import Tokenizer

__all__ = ["CONTEXT_TOKENS", "IncrementalDetokenizer"]

CONTEXT_TOKENS = 5  # prompt ids decoded before the output (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and finds stop strings.

    ``is_lazy`` (a request nobody reads before its end, with no stop strings
    to watch): tokens are only collected, and :meth:`finish` decodes them all
    at once. ``context``: the prompt's last :data:`CONTEXT_TOKENS` ids, decoded
    before the output (their text is not the output's).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), *, is_lazy: bool = False,
                 skip_special_tokens: bool = True, no_stop_trim: bool = False,
                 context: Sequence[int] = ()) -> None:
        if is_lazy and stop:
            raise ValueError("stop strings need incremental detokenization")
        self._tokenizer = tokenizer
        self._is_lazy = is_lazy
        self._stop = stop
        self._skip_special = skip_special_tokens
        self._no_stop_trim = no_stop_trim
        self._longest_stop = max((len(s) for s in stop), default=0)
        # SGLang's window, in tokens; widened when it holds too few characters (see _tail)
        self._tail_tokens = 1 + max((len(tokenizer.encode(s, add_special_tokens=False)) for s in stop), default=0)
        self._ids: list[int] = list(context)[-CONTEXT_TOKENS:] if context else []
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = self._num_context
        self._before_last = (0, 0, self._num_context)  # (text length, prefix offset, read offset) before the last token
        self._in_byte_run = False  # the output ends in a run of byte-fallback tokens
        self.text = ""          # stable text so far (a matched stop string cut away)
        self._emitted = 0       # characters of ``text`` already handed out
        self.matched_stop: str | None = None

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> None:
        """Append one token; sets ``matched_stop`` when a stop string appears."""
        if self.matched_stop is not None:
            return
        self._before_last = (len(self.text), self._prefix_offset, self._read_offset)
        self._ids.append(token_id)
        if self._is_lazy:
            return
        if self._stop and self._match_stop():
            return
        # a byte-fallback run goes on through tokens that render nothing (special tokens skipped)
        self._in_byte_run = self._tokenizer.is_byte_fallback(token_id) or (
            self._in_byte_run and not self._tokenizer.decode([token_id], skip_special_tokens=self._skip_special))
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd") and not self._in_byte_run:
            self.text += full[len(prefix):]
            # The previous chunk stays as context, so merges across the boundary render right.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def finish(self, *, drop_last: bool = False) -> None:
        """Flush whatever is left (an incomplete character becomes U+FFFD); ``drop_last`` leaves the last
        token's text out (the stop token a sequence ended on)."""
        if self.matched_stop is not None:
            return
        end = len(self._ids)
        if drop_last and end > self._num_context:
            text_len, self._prefix_offset, self._read_offset = self._before_last
            self.text = self.text[:text_len]
            end -= 1
        self._flush(end)

    def _flush(self, end: int) -> None:
        """Everything decoded up to ``end``, stable or not, goes into the text."""
        if self._read_offset < end:
            prefix = self._decode(self._prefix_offset, self._read_offset)
            full = self._decode(self._prefix_offset, end)
            self.text += full[len(prefix):]
            self._read_offset = end

    def _match_stop(self) -> bool:
        """SGLang's check after a token: the first stop string of the list in the output's end ends it."""
        tail = self._tail()
        matched = next((stop for stop in self._stop if stop in tail), None)
        if matched is None:
            return False
        self._flush(len(self._ids))
        at = self.text.find(matched, self._emitted)  # the first occurrence not yet streamed (SGLang: the first)
        if at != -1:
            self.text = self.text[:at + len(matched)] if self._no_stop_trim else self.text[:at]
        self.matched_stop = matched
        return True

    def _tail(self) -> str:
        """The output's end, special tokens shown: at least the longest stop string's length before the newest
        token's text (a stop string found in it ends in the newest token: earlier ones were looked for
        before)."""
        newest = self._tokenizer.decode(self._ids[-1:], skip_special_tokens=False)
        wanted = self._longest_stop + len(newest)
        num_outputs = len(self._ids) - self._num_context  # the prompt is no part of it (SGLang's ``tail_str``)
        num_tokens = min(self._tail_tokens, num_outputs)
        while True:
            tail = self._tokenizer.decode(self._ids[-num_tokens:], skip_special_tokens=False)
            if len(tail) >= wanted or num_tokens >= num_outputs:
                return tail
            num_tokens = min(2 * num_tokens, num_outputs)

    def take_delta(self, *, is_final: bool) -> str:
        """Text not yet handed out; unless final, the end that could begin a stop string is held back."""
        end = len(self.text)
        if not is_final and self.matched_stop is None:
            end = min(end - self._stop_prefix_len(), self._unseen_stop_at())
            end = max(self._emitted, end)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _unseen_stop_at(self) -> int:
        """Where the first stop string in the text not yet handed out begins (the text's length: none). The check
        after a token can miss one a while: a window that starts inside a byte-fallback run renders the whole
        run as U+FFFD. Held back, it is cut when the check finds it, as the answer not streamed is."""
        found = (self.text.find(stop, self._emitted) for stop in self._stop)
        return min((at for at in found if at != -1), default=len(self.text))

    def _stop_prefix_len(self) -> int:
        """The length of the longest end of the text that begins a stop string (0: none)."""
        window = self.text[-(self._longest_stop - 1):] if self._longest_stop > 1 else ""
        longest = 0
        for stop in self._stop:
            at = window.find(stop[0])
            while at != -1 and len(window) - at > longest:
                if stop.startswith(window[at:]):
                    longest = len(window) - at
                    break
                at = window.find(stop[0], at + 1)
        return longest
