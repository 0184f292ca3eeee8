"""From a ``/generate`` body to the engine sequences that answer it.

:func:`plan_generate` normalizes the body (:mod:`handoff.protocol.generate_sequences`:
every SGLang field, batches and ``n`` in SGLang's order), tokenizes each
distinct text once, decodes and resizes each prompt's images and expands their
placeholders (:mod:`node_engine.server.images`), and checks every sequence
before any is submitted, so a bad item (a bad image included) changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from handoff.protocol.generate_request import GenerateBody, GenerateFieldError, SamplingParamsBody
from handoff.protocol.generate_sequences import normalize
from handoff.service.errors import InvalidRequest, ServiceError
from node_engine.engine import Engine
from node_engine.request_gate import DEFAULT_MAX_NEW_TOKENS
from node_engine.server.generation import check_prompt_length, tokenize
from node_engine.server.generation_run import SequenceSpec
from node_engine.server.images import ImageLoader
from node_engine.vision.inputs import MultimodalPrompt
from node_engine.server.protocol import MAX_BATCH, to_sampling_params

# logprob list entries one request may ask for (each ~30 bytes of JSON, ~100 of Python objects while built)
MAX_LOGPROB_ENTRIES = 4_000_000


@dataclass(frozen=True)
class GeneratePlan:
    sequences: list[SequenceSpec]
    is_batch: bool          # answer a list
    n: int
    return_prompt_token_ids: bool = False


def refusal(exc: GenerateFieldError) -> ServiceError:
    """The 400 of a request the protocol module refused (``invalid_request`` or ``unsupported``)."""
    return ServiceError(str(exc), kind=exc.kind)


def check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.config.model_name:
        raise InvalidRequest(f"model {model!r} is not served here; this engine serves {engine.config.model_name!r}")


async def plan_generate(engine: Engine, body: GenerateBody, images: ImageLoader, *,
                        to_context_by_default: bool = False) -> GeneratePlan:
    """A sequence that leaves ``max_new_tokens`` out gets ``/generate``'s 128, or with ``to_context_by_default``
    (chat) what the context leaves; one that gives it as ``null`` gets the latter, as in SGLang (either is cut
    further when the run starts: :meth:`RequestGate.cap_new_tokens`). An empty batch (``text: []``) plans no
    sequence."""
    try:
        request = normalize(body, max_sequences=MAX_BATCH)
    except GenerateFieldError as exc:
        raise refusal(exc) from exc
    check_model(engine, body.model)
    if not request.sequences:
        return GeneratePlan([], request.is_batch, request.n, body.return_prompt_token_ids)
    firsts = [s for s in request.sequences if s.sample_index == 0]
    if any(s.images for s in firsts):
        images.check_supported("image_data")
    if firsts[0].text is not None:
        sent: list[str] = [s.text for s in firsts]  # type: ignore[misc]
        check_prompt_length(engine, sent)  # as sent: before a placeholder grows any of them
        texts = [images.normalize_text(text, len(s.images), _field(s.prompt_index, request.is_batch))
                 if s.images else text for text, s in zip(sent, firsts, strict=True)]
        id_lists = await tokenize(engine, texts)
    else:
        id_lists = [s.input_ids for s in firsts]  # type: ignore[misc]
    for ids, first in zip(id_lists, firsts, strict=True):  # every prompt's placeholders before any image is decoded
        if first.images:
            images.check_before_decoding(ids, first.images, _field(first.prompt_index, request.is_batch))
    prompts = [await _with_images(images, ids, first.images, _field(first.prompt_index, request.is_batch))
               for ids, first in zip(id_lists, firsts, strict=True)]
    sequences = []
    for seq in request.sequences:
        ids, mm = prompts[seq.prompt_index]
        # SGLang tells max_new_tokens left out (its default) from an explicit null: no limit but the context
        if _to_context(seq.sampling, to_context_by_default):
            limit = engine.gate.room_after(len(ids))
            sampling = _min_new_tokens_within(seq.sampling, limit)
        else:
            limit = engine.gate.default_max_new_tokens(len(ids))
            sampling = _default_within(seq.sampling, limit)
        try:
            params = to_sampling_params(sampling, limit,
                                        vocab_size=engine.arch.vocab_size, sample_index=seq.sample_index)
        except ValueError as exc:
            raise InvalidRequest(f"sampling_params: {exc}") from exc
        if seq.logprobs is not None and seq.logprobs.start_len > len(ids):
            raise InvalidRequest(f"logprob_start_len ({seq.logprobs.start_len}) is beyond the prompt "
                                 f"({len(ids)} tokens)")
        sequences.append(SequenceSpec(ids, params, seq.rid, seq.logprobs, seq.use_prefix_cache,  # ids shared, read-only
                                      seq.prompt_index, mm))
    num_entries = sum(_num_logprob_entries(spec) for spec in sequences)
    if num_entries > MAX_LOGPROB_ENTRIES:
        raise InvalidRequest(f"the logprobs asked for come to {num_entries} entries (positions x (1 + "
                             f"top_logprobs_num + token_ids_logprob) x sequences), more than {MAX_LOGPROB_ENTRIES}: "
                             "ask for fewer positions (logprob_start_len), fewer top logprobs or fewer samples")
    return GeneratePlan(sequences, request.is_batch, request.n, body.return_prompt_token_ids)


def _to_context(sampling: SamplingParamsBody, by_default: bool) -> bool:
    """No limit but the context's: ``max_new_tokens: null`` given (``sampling_params.py``: ``__post_init__``
    keeps it, ``verify`` skips the ``min_new_tokens`` bound, ``Scheduler.init_req_max_new_tokens`` runs to the
    end of the context), or left out where that is the default."""
    if "max_new_tokens" in sampling.model_fields_set:
        return sampling.max_new_tokens is None
    return by_default


def _min_new_tokens_within(sampling: SamplingParamsBody, room: int) -> SamplingParamsBody:
    """``min_new_tokens`` past what the context leaves holds EOS back to its end, where the length stops the
    sequence, as in SGLang (a negative one stays, for the 400)."""
    wanted = sampling.min_new_tokens
    if wanted is None or wanted <= room:
        return sampling
    return sampling.model_copy(update={"min_new_tokens": room})


def _default_within(sampling: SamplingParamsBody, limit: int) -> SamplingParamsBody:
    """SGLang bounds ``min_new_tokens`` by the default of 128 (``SamplingParams.verify``) before its scheduler cuts
    both to what fits: one within 128 is cut to ``limit`` here, one beyond stays for the 400."""
    if "max_new_tokens" in sampling.model_fields_set or (sampling.min_new_tokens or 0) > DEFAULT_MAX_NEW_TOKENS:
        return sampling
    return _min_new_tokens_within(sampling, limit)


def _num_logprob_entries(spec: SequenceSpec) -> int:
    """The most logprob entries ``spec``'s answer can hold: one list entry per position and id asked."""
    options = spec.logprobs
    if options is None:
        return 0
    num_prompt = len(spec.prompt_ids) - options.start_len if options.start_len >= 0 else 0
    positions = max(spec.params.max_new_tokens, 1) + num_prompt  # max_new_tokens 0: still the row after the prompt
    return positions * (1 + options.top_logprobs_num + len(options.token_ids or ()))


def _field(prompt_index: int, is_batch: bool) -> str:
    return f"image_data[{prompt_index}]" if is_batch else "image_data"


async def _with_images(images: ImageLoader, ids: list[int], items: tuple[object, ...], field: str,
                       ) -> tuple[list[int], MultimodalPrompt | None]:
    """A prompt's ids with its image placeholders expanded, and its images (None for a text prompt)."""
    if not items:
        images.check_no_placeholder(ids, field)
        return ids, None
    return await images.prepare(ids, items, field)
