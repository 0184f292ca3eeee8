"""One generation request inside the engine, and its lifecycle.

``WAITING`` → ``RUNNING`` → ``FINISHED``; a running request may be preempted
back to ``WAITING`` (its KV is dropped and recomputed later, its tokens kept).
Any other move is a bug and raises, naming the state it was in.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from handoff.protocol.errors import ErrorType
from handoff.protocol.generate_sequences import LogprobOptions
from handoff.protocol.generation import FinishReason as FinishJSON
from handoff.protocol.generation import finish_abort, finish_abort_waiting, finish_length, finish_stop
from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.logprobs import InputLogprobs, PromptLogprobs, TokenLogprobs
from node_engine.sampling import SamplingParams

if TYPE_CHECKING:
    from node_engine.vision.inputs import MultimodalPrompt


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ALLOWED = {
    RequestState.WAITING: {RequestState.RUNNING, RequestState.FINISHED},
    RequestState.RUNNING: {RequestState.WAITING, RequestState.FINISHED},
    RequestState.FINISHED: set(),
}


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class IllegalTransition(RuntimeError):
    pass


@dataclass
class RequestOutput:
    """What a request produced since its last output (the engine sends one per step)."""

    rid: str
    text_delta: str
    token_ids_delta: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    finish_json: FinishJSON | None = None  # SGLang's finish_reason object (handoff.protocol.generation)
    num_cached_tokens: int = 0             # prompt tokens whose KV came from the prefix cache
    num_retractions: int = 0               # times the request was preempted and recomputed
    output_logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids_delta (when asked)
    input_logprobs: InputLogprobs | None = None         # once, in the first output after the prompt's prefill
    scoring_logprobs: TokenLogprobs | None = None       # max_new_tokens 0: the top / token_ids row after the prompt
    error_type: str | None = None  # set (with ``error``) when the request failed instead of finishing
    error: str | None = None
    # the version serving when the engine thread handed this output over (:meth:`Outbox.deliver`): the weights
    # its tokens were made under, whatever an update changed since (SGLang reports an aborted request so); a final
    # output's is the version of its last tokens
    weight_version: str | None = None
    # a final output's: which output tokens each version made (:func:`weight_version_spans`)
    weight_versions: list[dict[str, Any]] | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    on_output: Callable[[RequestOutput], None]
    generator: torch.Generator | None = None
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None            # row of the request-to-slot table while running
    num_cached: int = 0               # tokens of all_ids whose KV is in the pool
    slots: list[torch.Tensor] = field(default_factory=list)  # prefill slot chunks owned by this request, in order
    decode_slots: list[int] = field(default_factory=list)    # then one slot per decoded token
    prefix_slots: torch.Tensor | None = None  # slots of a cached prefix it reuses (owned by the prefix cache)
    prefix_node: Any = None                   # the prefix cache node it locks while it runs
    cache_epoch: int = 0                      # the prefix cache's epoch when it was admitted
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    finish_json: FinishJSON | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    num_retractions: int = 0
    is_streaming: bool = False        # outputs every stream_interval tokens (else only the final one)
    logprobs: LogprobOptions | None = None   # what logprobs to return (None: none)
    use_prefix_cache: bool = True            # false: neither reuse cached KV nor leave its own
    prefill_only: bool = False               # max_new_tokens 0 that still prefills (prompt logprobs, n warm-up)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    scoring_logprobs: TokenLogprobs | None = None   # prefill_only: the row after the prompt (no token is kept)
    prompt_logprobs: PromptLogprobs | None = None   # computed so far (positions from logprob_start_len)
    prompt_logprobs_sent: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # when its first output token was made (time to first token)
    num_emitted_tokens: int = 0
    mm: MultimodalPrompt | None = None  # the prompt's images (vision-language models)
    # (the version before a change, output tokens made until then), one per change while it had tokens
    weight_version_events: list[tuple[str, int]] = field(default_factory=list)
    _cache_keys: list[int] | None = field(default=None, repr=False)

    def transition(self, new_state: RequestState) -> None:
        if new_state not in _ALLOWED[self.state]:
            raise IllegalTransition(f"request {self.rid}: cannot go from {self.state.value} to {new_state.value}")
        self.state = new_state

    @property
    def is_stream_output_due(self) -> bool:
        """A streaming request's output is due: its first tokens, then every ``stream_interval`` tokens."""
        if not self.is_streaming:
            return False
        num_unsent = len(self.output_ids) - self.num_emitted_tokens
        return num_unsent >= self.params.stream_interval or (self.num_emitted_tokens == 0 and num_unsent > 0)

    @property
    def prompt_logprob_next(self) -> int | None:
        """The next prompt position whose logits prompt logprobs need (None: none are left to compute)."""
        options = self.logprobs
        if options is None or not 0 <= options.start_len < len(self.prompt_ids) - 1:
            return None
        done = options.start_len + (len(self.prompt_logprobs.values) if self.prompt_logprobs else 0)
        return done if done < len(self.prompt_ids) - 1 else None

    def add_prompt_logprobs(self, computed: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = computed
        else:
            self.prompt_logprobs.extend(computed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids``."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt:end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[:end - num_prompt]

    def key_slice(self, start: int, end: int) -> list[int]:
        """``token_slice`` as the prefix cache keys it: an image's tokens stand for that image's content."""
        if self.mm is None:
            return self.token_slice(start, end)
        if self._cache_keys is None:
            self._cache_keys = self.mm.cache_keys(self.prompt_ids)
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self._cache_keys[start:end]
        return self._cache_keys[start:] + self.output_ids[max(0, start - num_prompt):end - num_prompt]

    @property
    def num_owned_slots(self) -> int:
        return sum(chunk.numel() for chunk in self.slots) + len(self.decode_slots)

    def take_slots(self) -> torch.Tensor | None:
        """Every slot this request owns, in token order (None if it owns none); it owns none afterwards."""
        parts = self.slots
        if self.decode_slots:
            parts = parts + [torch.tensor(self.decode_slots, dtype=torch.int64)]
        own = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        self.slots = []
        self.decode_slots = []
        return own

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    def set_finished(self, reason: FinishReason, matched: str | int | None, *, was_running: bool) -> None:
        """Record why it ended, and SGLang's ``finish_reason`` object for its answer."""
        self.finish_reason = reason
        self.matched_stop = matched
        if reason is FinishReason.STOP:
            self.finish_json = finish_stop(matched)
        elif reason is FinishReason.LENGTH:
            self.finish_json = finish_length(len(self.output_ids))
        else:
            self.finish_json = finish_abort() if was_running else finish_abort_waiting()

    def take_output(self) -> RequestOutput:
        """The tokens and text produced since the last call."""
        is_final = self.finish_reason is not None
        num_emitted = self.num_emitted_tokens
        new_ids = self.output_ids[num_emitted:]
        self.num_emitted_tokens = len(self.output_ids)
        input_logprobs = None
        if self.logprobs is not None and not self.prompt_logprobs_sent and (
                self.prompt_logprob_next is None and (self.output_ids or is_final)):
            input_logprobs = InputLogprobs.of(self.prompt_ids, self.prompt_logprobs, self.logprobs)
            self.prompt_logprobs_sent = True
        return RequestOutput(
            rid=self.rid, text_delta=self.detokenizer.take_delta(is_final=is_final), token_ids_delta=new_ids,
            num_prompt_tokens=len(self.prompt_ids), num_output_tokens=len(self.output_ids),
            finish_reason=self.finish_reason, finish_json=self.finish_json,
            num_cached_tokens=self.num_cached_prompt_tokens, num_retractions=self.num_retractions,
            output_logprobs=self.output_logprobs[num_emitted:len(self.output_ids)] if self.logprobs else None,
            input_logprobs=input_logprobs, scoring_logprobs=self.scoring_logprobs if is_final else None)


class RequestHandle:
    """The event-loop side of one request: its outputs, in order (:meth:`put` on the loop, from the engine)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        # the final output reached the loop: the request is over and its id given back (in the same call), so
        # the id may already name another client's request, read or not
        self.is_over = False
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        self.is_over = self.is_over or output.is_final
        self._queue.put_nowait(output)

    async def next(self) -> RequestOutput:
        return await self._queue.get()


def error_output(request: Request, kind: ErrorType, message: str) -> RequestOutput:
    """The final output of a request that failed (``kind``) instead of finishing."""
    return RequestOutput(request.rid, "", [], len(request.prompt_ids), len(request.output_ids),
                         error_type=kind.name, error=message)
