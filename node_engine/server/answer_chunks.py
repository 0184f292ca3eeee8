"""An engine output in SGLang's terms: a :class:`~handoff.protocol.generation.SequenceChunk`.

Logprobs become SGLang's ``[logprob, token_id, text]`` triples; ``text`` is the
token decoded on its own (special tokens included, as SGLang's
``batch_decode`` of one id gives it) when ``return_text_in_logprobs`` is set,
else ``None``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from handoff.protocol.generate_sequences import LogprobOptions
from handoff.protocol.generation import LogprobEntry, SequenceChunk, logprob_entries
from node_engine.logprobs import InputLogprobs, TokenLogprobs
from node_engine.request import RequestOutput
from node_engine.tokenizer import Tokenizer

Texts = Callable[[Sequence[int]], "list[str] | None"]


def _texts_for(tokenizer: Tokenizer, options: LogprobOptions) -> Texts:
    if not options.return_text:
        return lambda ids: None
    return lambda ids: [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _row(values: Sequence[float], ids: Sequence[int], texts: Texts) -> list[LogprobEntry]:
    return logprob_entries(values, ids, texts(ids))


def _output_lists(logprobs: list[TokenLogprobs], ids: list[int], options: LogprobOptions,
                  texts: Texts) -> tuple[list, list, list]:
    tokens = logprob_entries([lp.logprob for lp in logprobs], ids, texts(ids))
    tops = [_row(*lp.top, texts) if lp.top is not None else None for lp in logprobs] \
        if options.top_logprobs_num else []
    picked = [_row(lp.token_ids, options.token_ids, texts) if lp.token_ids is not None else None
              for lp in logprobs] if options.token_ids is not None else []
    return tokens, tops, picked


def _input_lists(computed: InputLogprobs, options: LogprobOptions, texts: Texts) -> tuple[list, list | None,
                                                                                           list | None]:
    tokens = logprob_entries(computed.values, computed.token_ids, texts(computed.token_ids))
    tops = None if computed.top is None else [
        _row(*row, texts) if row is not None else None for row in computed.top]
    picked = None if computed.token_ids_logprobs is None else [
        _row(row, options.token_ids or (), texts) if row is not None else None for row in computed.token_ids_logprobs]
    return tokens, tops, picked


def chunk_of(output: RequestOutput, options: LogprobOptions | None, tokenizer: Tokenizer,
             weight_version: str | None = None) -> SequenceChunk:
    chunk = SequenceChunk(text=output.text_delta, output_ids=output.token_ids_delta,
                          prompt_tokens=output.num_prompt_tokens, completion_tokens=output.num_output_tokens,
                          cached_tokens=output.num_cached_tokens, num_retractions=output.num_retractions,
                          finish_reason=output.finish_json, weight_version=weight_version,
                          weight_versions=output.weight_versions)
    if options is None:
        return chunk
    texts = _texts_for(tokenizer, options)
    if output.output_logprobs:
        chunk.output_token_logprobs, chunk.output_top_logprobs, chunk.output_token_ids_logprobs = _output_lists(
            output.output_logprobs, output.token_ids_delta, options, texts)
    scoring = output.scoring_logprobs
    if scoring is not None:  # max_new_tokens 0: one top / token_ids row, no token (as SGLang answers a score)
        if options.top_logprobs_num and scoring.top is not None:
            chunk.output_top_logprobs = [_row(*scoring.top, texts)]
        if options.token_ids is not None and scoring.token_ids is not None:
            chunk.output_token_ids_logprobs = [_row(scoring.token_ids, options.token_ids, texts)]
    if output.input_logprobs is not None:
        chunk.input_token_logprobs, chunk.input_top_logprobs, chunk.input_token_ids_logprobs = _input_lists(
            output.input_logprobs, options, texts)
    return chunk
