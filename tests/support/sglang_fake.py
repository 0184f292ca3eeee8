"""A stand-in for an SGLang 0.5.23 server, for the sidecar's SGLang adapter (SGLang itself needs a GPU).

It reproduces, over real HTTP, what SGLang does with the calls the sidecar
sends, each behaviour taken from SGLang's source (paths below are relative to
``sglang/srt/`` of the 0.5.23 wheel, and ``csrc/core.cpp`` of
torch_memory_saver 0.0.10, which SGLang's memory saver calls):

- **The scheduler dies on an exception.** ``managers/scheduler.py:6370-6378``:
  any exception in the scheduler loop sends SIGQUIT to the server and kills the
  process group. Here: :func:`die` (``os._exit``), the connection dropped
  without an answer.
- **Release asserts the server is idle.** ``managers/scheduler_components/
  weight_updater.py:339-341``: ``assert self.is_fully_idle(...)``; with a
  request running or queued the assertion fails and the server dies. Idle
  also needs the last batch empty (``scheduler.py:5344-5351``), which the
  loop clears only on its next iteration after the batch's outputs went out
  (``scheduler.py:2039-2056``): a release sent the moment the last answer
  arrived can still find the server busy. Here a finished request counts as
  running for ``LAST_BATCH_SECONDS`` more.
- **Tags:** null or ``[]`` means every tag (``weight_updater.py:345-346`` and
  ``386-387``); the tags are ``kv_cache``, ``weights``, ``cuda_graph``
  (``constants.py:2-9``). An unknown tag is recorded and frees nothing.
- **Releasing a released tag kills the process.** torch_memory_saver
  ``csrc/core.cpp:182-187``: ``pause`` on an allocation that is not active
  prints "Cannot pause allocation that is not active" and calls ``exit(1)``.
- **Resuming a tag that was not released throws.** ``weight_updater.py:389-390``:
  ``self.offload_tags.remove(tag)`` raises KeyError in the scheduler, which
  dies (``core.cpp:234-239`` would ``exit(1)`` as well).
- **Release and resume answer 200 with ``null``.** ``entrypoints/
  http_server.py:1575-1596``: the handlers return nothing (an error inside the
  tokenizer manager would be a 400 ``{"error": {"message"}}``, 2246-2250).
- **Weights come back as garbage without a CPU backup.** ``weight_updater.py:
  368-374`` pauses the ``weights`` region; a region made without
  ``enable_cpu_backup`` is unmapped with no copy (``core.cpp:190-197``) and
  remapped uninitialised on resume (``core.cpp:241-256``). Here: after such a
  resume the model produces different (wrong) tokens until a reload.
- **Generating with a tag released touches unmapped memory** (``core.cpp:
  196-197`` unmaps it): an illegal access on the GPU, an exception in the
  scheduler, the server dies. ``GET /health`` generates one token
  (``http_server.py:721-767``; ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
  defaults to true, ``environ.py:344``), so it dies the same way.
- **flush_cache refuses while requests are pending.** ``scheduler.py:
  5518-5547`` flushes only when fully idle; ``http_server.py:1025-1040``
  answers 200 with a text body on success, 400 ``Flush cache failed.`` (text)
  otherwise; with the default ``timeout=0`` it does not wait
  (``managers/scheduler_components/flush_wrapper.py:28-30``).
- **Generation answers** (``managers/tokenizer_manager.py:2506-2669``):
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}}``;
  a stream repeats the whole text and ids so far in every event (the default
  ``incremental_streaming_output`` false), then ``data: [DONE]``;
  ``finish_reason`` is ``{"type": "length", "length": n}`` or ``{"type":
  "abort", "message": ...}`` (``managers/schedule_batch.py:320-345``). A
  batch (``text`` a list, ``input_ids`` a list of lists) or ``n`` > 1 answers
  a list, and each stream event carries its ``index``; rids as SGLang makes
  them (a string rid ``rid_i`` per prompt, fresh ones per sample of n > 1).
- **Generation errors** (``http_server.py:933-990``): a body that is not a JSON
  object is FastAPI's 400 ``{"object": "error", "message", "type", "param",
  "code"}``; a ValueError while normalizing (no prompt, empty ``input_ids``,
  a rid list of the wrong length or with duplicates, a rid already running)
  is 400 ``{"error": {"message"}}``, and for a stream (already 200) one event
  ``{"error": {"message", "type": "invalid_request_error", "code", "retryable"}}``
  then ``data: [DONE]``.
- **A client that goes away aborts its request**: a stream's generator is
  closed (``tokenizer_manager.py:966-980``, ``_release_req_states_on_failure``);
  a non-stream request polls ``request.is_disconnected()`` every
  ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` (4 s; ``tokenizer_manager.py:1955-1975``),
  here every ``DISCONNECT_POLL_S``. Each is recorded as
  ``abort <rid> (client disconnected)`` in the calls.
- ``POST /abort_request`` answers 200 with no body (``http_server.py:1721-1731``);
  ``POST /update_weights_from_disk`` answers ``{"success", "message",
  "num_paused_requests"}``, 400 when it fails (``http_server.py:1300-1326``);
  ``GET /get_server_info`` is the flat server arguments plus ``version`` and
  ``startup_time``, an object of startup durations (``http_server.py:853-890``,
  ``observability/startup_time.py``; :func:`startup_time`), ``api_key`` and
  ``admin_api_key`` among them as given (``arg_groups/fields/serving.py:160-167``),
  and ``launch_command``, the command line joined with only the watermark
  config hidden (``server_args.py:717``, ``sampling/watermarking/core.py:110``);
  ``--server-info-extra`` adds fields (a test's nested secrets). The fake does
  not check the keys (SGLang requires ``api_key`` on every endpoint but
  ``/health*``, ``utils/auth.py:74-150``);
  ``GET /model_info`` has ``model_path``, ``is_generation``, ``weight_version``
  (``http_server.py:812-850``).
- Weight calls beyond disk (``http_server.py:1404-1557``): ``/update_weights_from_tensor``,
  ``/update_weights_from_distributed``, ``/init_weights_update_group``,
  ``/destroy_weights_update_group``, ``/begin_weight_update``,
  ``/end_weight_update`` answer ``{"success", "message"}`` (400 when they
  fail); ``/update_weight_version`` answers ``{"success", "message",
  "new_version"}``. A tensor or broadcast update outside a session
  (``begin_weight_update`` .. ``end_weight_update``) answers 400 ``success:
  false`` (``weight_updater.py:192-197``, ``234-239``); a second begin while
  one is open, or an end without one, too (``weight_updater.py:311``, ``325``).
  A broadcast into a group not joined fails to receive (400, the assertion's
  message, ``model_runner_components/weight_updater.py:265-268``).
  An update writes into the weights region: with it released, an illegal
  access, the server dies. The fake checks nothing of the tensors.
- **An update that cannot flush fails after it loaded.** Every update (disk,
  tensor, broadcast) with ``flush_cache`` (default true) flushes once the
  weights are in; with requests still running (an ``in_place`` pause) the
  flush is refused and the call answers 400 ``success: false`` "Weights were
  updated, but the cache was not flushed ..." with the new weights loaded
  (``weight_updater.py:117-130``, ``167-170``, ``232-235``), while the version
  and model path ``/model_info`` reports stay the old ones (the tokenizer
  adopts them only on success: ``tokenizer_manager.py:2382-2383``, ``2318``,
  ``tokenizer_control_mixin.py:592-594``). A successful update with a
  ``weight_version`` adds " Weight version updated to ..." to its message.
- **A disk reload that fails part way does not roll back.**
  ``model_executor/model_runner_components/weight_updater.py:193`` points the
  model config at the new path before loading; when a tensor fails part way
  (229-237) the "rollback" reads the weights again from that config, the new
  checkpoint: a failure that happens again raises outside the ``try``, the
  scheduler dies; one that does not (a transient read error) leaves the new
  checkpoint's weights loaded while the call answers 400 "Failed to update
  weights: ...\nRolling back to original weights." and ``/model_info`` keeps
  the old path and version. Injected with ``POST /_fake/next`` ``{"path":
  "/update_weights_from_disk", "load_fails": message, "fails_again": bool}``;
  ``weights_from`` in ``/_fake/state`` says which checkpoint the weights hold.
- ``/update_weight_version`` aborts every request first unless
  ``abort_all_requests`` is false (default true, ``io_struct.py:2159``;
  ``http_server.py:1533-1534``).
- Pause (``tokenizer_manager.py:2267-2286``; modes in ``io_struct.py:
  1927-1946``): ``abort`` aborts every request; ``retract`` and ``in_place``
  stop the scheduler with the requests kept (retracted ones wait in the queue,
  which the idle check ignores while paused: ``scheduler.py:5353-5357``;
  in-place ones stay running, so the server is not idle); new requests wait
  until ``/continue_generation``.
- Without ``--enable-memory-saver`` SGLang uses a no-op memory saver
  (``utils/torch_memory_saver_adapter.py:50-52``): release and resume do
  nothing and answer as usual.

Memory: each tag holds a real allocation (``--tag-mib``), freed on release and
made again on resume, so the process's resident set moves as SGLang's device
memory would. ``GET /_fake/state`` shows what the fake holds (for assertions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from handoff.service.serve import add_server_args, serve

SGLANG_TAGS = ("kv_cache", "weights", "cuda_graph")   # constants.py:2-9, in GPU_MEMORY_ALL_TYPES order
TOKEN_SECONDS = 0.01                                   # one decode step
LAST_BATCH_SECONDS = 0.5  # a finished batch counts until the next loop iteration (ms in SGLang; longer here, so
#                          a release sent the moment the last answer arrives would find the server busy)
VERSION = "0.5.23"
DISCONNECT_POLL_S = 0.1  # SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT (4 s, environ.py:1679), shorter here


def die(reason: str) -> None:
    """The scheduler hit an exception: scheduler.py:6370-6378 kills the whole server, no answer sent."""
    print(f"[sglang-fake] scheduler died: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


@dataclass
class Running:
    rid: str
    aborted: bool = False
    finished: bool = False  # its answer is complete: the rid is free (rid_to_state dropped it), the batch lingers


@dataclass
class FakeSglang:
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool
    tag_bytes: int
    model_path: str = "/models/fake-sglang"
    weight_version: str = "default"
    offload_tags: set[str] = field(default_factory=set)
    regions: dict[str, mmap.mmap] = field(default_factory=dict)
    weights_garbage: bool = False
    weights_from: str | None = None  # the checkpoint the weights were read from, when not the one served
    load_fault: dict[str, Any] | None = None  # the next disk reload fails part way (POST /_fake/next)
    running: dict[str, Running] = field(default_factory=dict)
    paused: bool = False
    pause_mode: str | None = None
    is_session_open: bool = False
    groups: set[str] = field(default_factory=set)  # weight update groups joined (init .. destroy)
    next_answers: dict[str, dict] = field(default_factory=dict)  # POST /_fake/next
    calls: list[str] = field(default_factory=list)
    media: list[Any] = field(default_factory=list)  # the image_data of each /generate, the messages of each chat
    num_model_info: int = 0
    num_metrics: int = 0  # GET /metrics answered
    startup_time: float = field(default_factory=time.time)
    tp_size: int = 1
    api_key: str | None = None
    admin_api_key: str | None = None
    launch_command: str = ""
    server_info_extra: dict[str, Any] = field(default_factory=dict)
    # GET /metrics (SGLang's --enable-metrics); a test may make it answer anything (POST /_fake/metrics)
    metrics_text: str = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0.0\n"
    metrics_type: str = "text/plain; version=0.0.4; charset=utf-8"

    def __post_init__(self) -> None:
        for tag in SGLANG_TAGS:
            self.regions[tag] = _allocate(self.tag_bytes)

    # -- memory (weight_updater.py:337-422) -----------------------------------------------
    def release(self, tags: list[str] | None) -> None:
        if not self.is_idle():
            die("AssertionError: release_memory_occupation should be called only when server is idle.")
        tags = list(SGLANG_TAGS) if not tags else tags
        for tag in tags:
            if self.enable_memory_saver and tag in self.offload_tags and tag in SGLANG_TAGS:
                die(f"[torch_memory_saver.cpp] Cannot pause allocation that is not active. tag={tag}")
            self.offload_tags.add(tag)
        if self.enable_memory_saver:
            for tag in tags:
                if tag in self.regions:
                    self.regions.pop(tag).close()

    def resume(self, tags: list[str] | None) -> None:
        tags = list(SGLANG_TAGS) if not tags else tags
        for tag in tags:
            if tag not in self.offload_tags:
                die(f"KeyError: '{tag}'")
            self.offload_tags.remove(tag)
        if self.enable_memory_saver:
            for tag in tags:
                if tag in SGLANG_TAGS and tag not in self.regions:
                    self.regions[tag] = _allocate(self.tag_bytes)
                    if tag == "weights" and not self.enable_weights_cpu_backup:
                        self.weights_garbage = True

    def touch_memory(self, what: str) -> None:
        """A forward pass reads every region; a released one is unmapped (core.cpp:196-197)."""
        if self.enable_memory_saver and any(tag in SGLANG_TAGS for tag in self.offload_tags):
            die(f"{what}: CUDA error: an illegal memory access was encountered (released: {sorted(self.offload_tags)})")

    def forget(self, job: Running) -> None:
        """The scheduler's last batch let go of ``job`` (not of a later request that reused its rid)."""
        if self.running.get(job.rid) is job:
            del self.running[job.rid]

    def is_idle(self) -> bool:
        """is_fully_idle(ignore_waiting=paused): retracted requests wait in the queue, which does not count."""
        return not self.running or self.pause_mode == "retract"

    def token(self, prompt: list[int], index: int) -> int:
        if self.weights_garbage or self.weights_from is not None:
            return (hash((tuple(prompt), index, self.weights_from or "garbage")) & 0x7FFFFFFF) % 250
        return (sum(prompt) + 7 * index) % 250


NAMES = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
         "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight")


def _allocate(num_bytes: int) -> mmap.mmap:
    """Anonymous pages of its own (closed on release, so they go back to the OS at once), every page touched:
    resident, as device memory would be."""
    region = mmap.mmap(-1, num_bytes)
    for offset in range(0, num_bytes, mmap.PAGESIZE):
        region[offset] = 1
    return region


def startup_time(fake: FakeSglang) -> dict[str, Any]:
    """SGLang's ``startup_time``: the durations of its start's phases (``observability/startup_time.py:62-70``, set
    at ``http_server.py:284``), an object that differs from one process to the next."""
    return {"load_weight": 1.5, "kv_cache_allocation": 0.25, "scheduler_e2e": 3.0, "cuda_graph": {},
            "tokenizer_e2e": fake.startup_time % 1000}


def _text(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


class GenerateError(ValueError):
    """A ValueError SGLang raises while it normalizes a ``/generate`` body or registers its rids."""


def _prompts(fake: FakeSglang, body: dict[str, Any]) -> tuple[list[list[int]], list[str], bool]:
    """``(prompts, rids, is_single)`` as ``GenerateReqInput.normalize_batch_and_arguments`` and
    ``_init_req_state`` make them (``io_struct.py:440-456``, ``479-506``, ``518-545``, ``760-774``,
    ``tokenizer_manager.py:3834-3837``); n > 1 expands each prompt into n samples of fresh rids."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise GenerateError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # text wins over input_ids, as in _determine_batch_size
        is_single = isinstance(text, str)
        prompts = [[ord(c) for c in t] for t in ([text] if is_single else text)]
    elif not input_ids:
        raise GenerateError("input_ids cannot be empty.")
    else:
        is_single = isinstance(input_ids[0], int)
        prompts = [list(input_ids)] if is_single else [list(ids) for ids in input_ids]
    n = _num_samples(body.get("sampling_params"))
    is_single = is_single and n == 1
    rid = body.get("rid")
    if is_single:
        rids = [str(rid or uuid.uuid4().hex)]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(len(prompts))]
    elif len(rid) != len(prompts):
        raise GenerateError("The specified rids length mismatch with the batch_size for batch processing.")
    elif len(set(rid)) != len(rid):
        raise GenerateError(f"Duplicate request IDs detected within the request: {sorted(set(rid))}")
    else:
        rids = [str(r) for r in rid]
    for r in rids:
        if r in fake.running and not fake.running[r].finished:  # tokenizer_manager.py:2774: freed when it ends
            raise GenerateError(f"Duplicate request ID detected: {r}")
    if n > 1:  # _handle_batch_request: every sample is a request of its own, with a rid of its own
        prompts = [p for p in prompts for _ in range(n)]
        rids = [uuid.uuid4().hex for _ in prompts]
    return prompts, rids, is_single


def _num_samples(params: Any) -> int:
    """``n`` of the sampling parameters (a list of them shares one, ``io_struct.py:527-535``)."""
    one = params[0] if isinstance(params, list) and params else params
    return int(one.get("n", 1)) if isinstance(one, dict) else 1


def _max_new_tokens(params: Any, index: int, n: int) -> int:
    one = params[index // n] if isinstance(params, list) else (params or {})
    return int(one.get("max_new_tokens", 16))


def _error_answer(message: str, *, stream: bool) -> Response:
    """A ValueError while generating: non-stream, 400 ``{"error": {"message"}}`` (``http_server.py:2246-2250``); a
    stream is already 200, so one error event and ``[DONE]`` (``http_server.py:954-978``)."""
    if not stream:
        return JSONResponse({"error": {"message": message}}, status_code=400)
    event = {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}
    return Response(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n", media_type="text/event-stream")


def _bad_request(message: str) -> Response:
    """FastAPI's validation error as SGLang answers it: 400 ``ErrorResponse`` (``http_server.py:636-692``)."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
                        status_code=400)


def create_app(fake: FakeSglang) -> Any:
    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return _bad_request(f"JSON decode error: {exc}")
        if not isinstance(body, dict):
            return _bad_request("Input should be a valid dictionary or object to extract fields from")
        fake.calls.append("generate")
        if body.get("image_data") is not None:
            fake.media.append(body["image_data"])
        is_stream = bool(body.get("stream"))
        try:
            prompts, rids, is_single = _prompts(fake, body)
        except GenerateError as exc:
            return _error_answer(str(exc), stream=is_stream)
        while fake.paused:  # tokenizer_manager.py:2267-2286: new requests wait until continue_generation
            await asyncio.sleep(0.01)
        params = body.get("sampling_params") or {}
        n = _num_samples(params)
        jobs = [Running(rid) for rid in rids]
        fake.touch_memory("generate")
        limits = [_max_new_tokens(params, i, n) for i in range(len(jobs))]
        outputs: list[list[int]] = [[] for _ in jobs]
        finished: list[dict[str, Any] | None] = [None for _ in jobs]

        def answer(i: int) -> dict[str, Any]:
            ids = outputs[i]
            out = {"text": _text(ids), "output_ids": list(ids), "meta_info": {
                "id": jobs[i].rid, "finish_reason": finished[i], "prompt_tokens": len(prompts[i]),
                "weight_version": fake.weight_version, "completion_tokens": len(ids), "cached_tokens": 0}}
            if not is_single:
                out["index"] = i  # _stream_batch_responses (a whole batch answer is a list, in order)
            return out

        async def steps() -> AsyncIterator[list[int]]:
            """One decode step of every running sub-request; yields the indexes that made progress. The requests run
            from its start: a stream whose client left before its first step never ran, and holds nothing."""
            for job in jobs:
                fake.running[job.rid] = job
            try:
                empty = [i for i, limit in enumerate(limits) if limit <= 0]
                for i in empty:
                    finished[i] = {"type": "length", "length": 0}
                if empty:
                    yield empty
                for step in range(max(limits, default=0)):
                    await asyncio.sleep(TOKEN_SECONDS)
                    while fake.paused and not any(job.aborted for job in jobs):  # retract / in_place: kept
                        await asyncio.sleep(TOKEN_SECONDS)
                    moved = []
                    for i, job in enumerate(jobs):
                        if finished[i] is not None:
                            continue
                        if job.aborted:
                            finished[i] = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                                           "err_type": None}
                        else:
                            fake.touch_memory("decode")
                            outputs[i].append(fake.token(prompts[i], step))
                            if len(outputs[i]) >= limits[i]:
                                finished[i] = {"type": "length", "length": len(outputs[i])}
                        moved.append(i)
                    if moved:
                        yield moved
                    if all(f is not None for f in finished):
                        return
            finally:
                for i, job in enumerate(jobs):
                    if finished[i] is None:  # left unfinished: the client went away (generate_request's cleanup)
                        fake.calls.append(f"abort {job.rid} (client disconnected)")
                    job.finished = True
                    # The batch that finished stays the scheduler's last_batch until its next loop iteration
                    # (scheduler.py:2039-2056), and is_fully_idle wants it empty (scheduler.py:5344-5351).
                    asyncio.get_running_loop().call_later(LAST_BATCH_SECONDS, fake.forget, job)

        if is_stream:
            async def events() -> AsyncIterator[bytes]:
                async for moved in steps():
                    for i in moved:
                        yield b"data: " + json.dumps(answer(i)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        # _stream_one_response: a non-stream request polls its client every SGLANG_REQUEST_STATE_WAIT_TIMEOUT
        # (4 s) and aborts once it is gone (here every DISCONNECT_POLL_S)
        gen = steps()
        try:
            next_poll = time.monotonic() + DISCONNECT_POLL_S
            async for _ in gen:
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        break
        finally:
            await gen.aclose()
        if any(f is None for f in finished):
            return _error_answer("Request is disconnected from the client side (type 1). Abort request", stream=False)
        return JSONResponse(answer(0) if is_single else [answer(i) for i in range(len(jobs))])

    async def chat(request: Request) -> Response:  # recorded and answered "ok" (the sidecar passes chat through)
        body = await request.json()
        fake.calls.append("chat")
        fake.media.append(body.get("messages"))
        return JSONResponse({"id": "chatcmpl-fake", "object": "chat.completion", "model": fake.model_path,
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}]})

    async def completions(request: Request) -> Response:  # SGLang's OpenAI server, answered "ok" (passed through)
        try:
            body = await request.json()
        except ValueError as exc:
            return _bad_request(f"JSON decode error: {exc}")
        if not isinstance(body, dict) or "prompt" not in body:  # CompletionRequest.prompt is required
            return _bad_request("1 validation error for CompletionRequest\nprompt\n  Field required")
        fake.calls.append("completions")
        answer = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                  "model": fake.model_path, "choices": [{"index": 0, "text": "ok", "logprobs": None,
                                                         "finish_reason": "length", "matched_stop": None}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        if body.get("stream"):
            return Response(b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n",
                            media_type="text/event-stream")
        return JSONResponse(answer)

    async def abort_request(request: Request) -> Response:
        body = await request.json()
        for job in list(fake.running.values()):
            if body.get("abort_all") or job.rid == body.get("rid"):
                job.aborted = True
        return Response(status_code=200)

    async def release(request: Request) -> Response:
        body = await request.json()
        fake.calls.append(f"release {body.get('tags')}")
        fake.release(body.get("tags"))
        return JSONResponse(None)

    async def resume(request: Request) -> Response:
        body = await request.json()
        fake.calls.append(f"resume {body.get('tags')}")
        fake.resume(body.get("tags"))
        return JSONResponse(None)

    async def flush_cache(request: Request) -> Response:
        fake.calls.append("flush_cache")
        if fake.is_idle():
            return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n", status_code=200)
        return Response("Flush cache failed.\n", status_code=400)

    async def update_weights_from_disk(request: Request) -> Response:
        body = await request.json()
        fake.calls.append("update_weights_from_disk")
        if "weights" in fake.offload_tags and fake.enable_memory_saver:
            die("update_weights_from_disk: CUDA error: an illegal memory access was encountered (weights released)")
        if not os.path.isdir(body["model_path"]):
            return JSONResponse({"success": False, "message": f"Failed to get weights iterator: {body['model_path']}",
                                 "num_paused_requests": 0}, status_code=400)
        fault, fake.load_fault = fake.load_fault, None
        if fault is not None:  # weight_updater.py:229-237: the rollback reads the new checkpoint again
            if fault.get("fails_again"):
                die(f"update_weights_from_disk: the rollback failed too: {fault['load_fails']}")
            fake.weights_garbage, fake.weights_from = False, body["model_path"]
            return JSONResponse({"success": False, "num_paused_requests": 0, "message": (
                f"Failed to update weights: {fault['load_fails']}.\nRolling back to original weights.")},
                status_code=400)
        fake.weights_garbage = False
        answer = loaded(body, "Succeeded to update model weights.", num_paused_requests=0)
        if answer.status_code == 200:  # tokenizer_manager.py:2382-2383: the served path moves only on success
            fake.model_path, fake.weights_from = body["model_path"], None
        elif body["model_path"] != fake.model_path:  # loaded, the flush refused: the new weights under the old path
            fake.weights_from = body["model_path"]
        return answer

    def loaded(body: dict[str, Any], message: str, **extra: Any) -> JSONResponse:
        """The weights are in: the flush after them (weight_updater.py:117-130) decides the answer, and the version
        /model_info reports moves only with a success (tokenizer_control_mixin.py:592-594)."""
        if body.get("flush_cache", True) and not fake.is_idle():
            return JSONResponse({"success": False, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running or queued. "
                "Retract or finish them, then call /flush_cache."), **extra}, status_code=400)
        if body.get("weight_version") is not None:
            fake.weight_version = body["weight_version"]
            message += f" Weight version updated to {fake.weight_version}."
        return JSONResponse({"success": True, "message": message, **extra})

    async def pause_generation(request: Request) -> Response:
        body = await request.json()
        fake.calls.append(f"pause {body.get('mode', 'abort')}")
        fake.paused, fake.pause_mode = True, body.get("mode", "abort")
        if fake.pause_mode == "abort":
            for job in fake.running.values():
                job.aborted = True
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request) -> Response:
        fake.calls.append("continue")
        fake.paused, fake.pause_mode = False, None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def weight_update(request: Request) -> Response:
        body = await request.json()
        path = request.url.path.strip("/")
        fake.calls.append(path)
        if not fake.is_session_open:
            return JSONResponse({"success": False, "message": f"{path} must run between "
                                 "begin_weight_update() and end_weight_update()"}, status_code=400)
        group = body.get("group_name", "weight_update_group")
        if path == "update_weights_from_distributed" and group not in fake.groups:
            return JSONResponse({"success": False, "message": (
                f"Failed to receive weights: Group {group} not in {sorted(fake.groups)}. Please call "
                "`init_weights_update_group` first.")}, status_code=400)
        if "weights" in fake.offload_tags and fake.enable_memory_saver:
            die(f"{request.url.path}: CUDA error: an illegal memory access was encountered (weights released)")
        fake.weights_garbage = False
        return loaded(body, "Succeeded to update parameter online." if path == "update_weights_from_distributed"
                      else "Success")

    async def weight_call(request: Request) -> Response:
        body = await request.json()
        path = request.url.path.strip("/")
        fake.calls.append(path)
        group = body.get("group_name", "weight_update_group")
        if path == "init_weights_update_group":  # model_runner_components/weight_updater.py:131-140
            fake.groups.add(group)
            return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})
        if path == "destroy_weights_update_group":  # model_runner_components/weight_updater.py:146-154
            if group not in fake.groups:
                return JSONResponse({"success": False, "message": "The group to be destroyed does not exist."},
                                    status_code=400)
            fake.groups.discard(group)
            return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})
        if fake.is_session_open == (path == "begin_weight_update"):  # weight_updater.py:308-313, 322-327
            return JSONResponse({"success": False, "message": "a weight-update session is already open; call "
                                 "end_weight_update() first" if fake.is_session_open else "no weight-update session "
                                 "is open; call begin_weight_update() first"}, status_code=400)
        fake.is_session_open = path == "begin_weight_update"
        return JSONResponse({"success": True, "message": "Success"})

    async def weights_checker(request: Request) -> Response:
        """``http_server.py:1599-1618``, ``utils/weight_checker.py``: the body is optional; ``reset_tensors`` writes
        random values into the weights (served as they are); an unknown action is 400 ``Unsupported action=...``."""
        raw = await request.body()
        body = json.loads(raw) if raw.strip() else {}
        action = body.get("action", "checksum")
        fake.calls.append(f"weights_checker {action}")
        if action == "reset_tensors":
            fake.weights_garbage = True
        elif action == "checksum":  # one rank per TP rank, each naming a 7B model's tensors (Qwen2.5-7B: 339)
            checksums = {f"model.layers.{n // 12}.{NAMES[n % 12]}": f"{n:016x}" for n in range(339)}
            ranks = [{"checksums": checksums, "per_gpu_checksum": "0" * 64, "parallelism_info": {
                "role": "target", "tp_rank": rank, "tp_size": fake.tp_size, "dp_rank": 0, "dp_size": 1,
                "pp_rank": 0, "pp_size": 1, "rank": rank, "size": fake.tp_size}} for rank in range(fake.tp_size)]
            return JSONResponse({"success": True, "message": "Success.", "ranks": ranks,
                                 "per_engine_checksum": "0" * 64})
        elif action not in ("snapshot", "compare"):
            return JSONResponse({"success": False, "message": f"Unsupported action={action!r}"}, status_code=400)
        return JSONResponse({"success": True, "message": "Success."})

    async def update_weight_version(request: Request) -> Response:
        body = await request.json()
        fake.calls.append("update_weight_version")
        if body.get("abort_all_requests", True):  # http_server.py:1533-1534
            for job in fake.running.values():
                job.aborted = True
        fake.weight_version = body["new_version"]
        return JSONResponse({"success": True, "message": f"Weight version updated to {fake.weight_version}",
                             "new_version": fake.weight_version})

    async def health(request: Request) -> Response:
        fake.calls.append("health")
        fake.touch_memory("health_generate")
        return Response(status_code=200)

    async def ready(request: Request) -> Response:  # http_server.py:714-718: 503 while paused (or not healthy)
        return Response(status_code=503 if fake.paused else 200)

    async def ping(request: Request) -> Response:  # http_server.py:2190-2199: 200 when healthy, paused or not
        return Response(status_code=200)

    async def server_info(request: Request) -> Response:
        return JSONResponse({"model_path": fake.model_path, "enable_memory_saver": fake.enable_memory_saver,
                             "device": "cpu",  # the fake's regions are host memory (SGLang itself says cuda)
                             "enable_weights_cpu_backup": fake.enable_weights_cpu_backup, "tp_size": fake.tp_size,
                             "api_key": fake.api_key, "admin_api_key": fake.admin_api_key,
                             "launch_command": fake.launch_command, **fake.server_info_extra,
                             "startup_time": startup_time(fake), "internal_states": [{}], "version": VERSION,
                             "frontend": "python"})

    async def model_info(request: Request) -> Response:
        fake.num_model_info += 1
        return JSONResponse({"model_path": fake.model_path, "is_generation": True,
                             "weight_version": fake.weight_version, "model_type": "llama"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": fake.model_path, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        fake.num_metrics += 1
        return Response(fake.metrics_text, media_type=fake.metrics_type)

    async def set_metrics(request: Request) -> Response:  # fault injection: what /metrics answers from now on
        body = await request.json()
        fake.metrics_text, fake.metrics_type = body["text"], body.get("content_type", fake.metrics_type)
        return JSONResponse({"ok": True})

    async def fake_state(request: Request) -> Response:
        return JSONResponse({"offload_tags": sorted(fake.offload_tags), "regions": sorted(fake.regions),
                             "weights_garbage": fake.weights_garbage, "weights_from": fake.weights_from,
                             "running": len(fake.running),
                             "is_session_open": fake.is_session_open, "weight_version": fake.weight_version,
                             "calls": fake.calls, "media": fake.media, "num_model_info": fake.num_model_info,
                             "num_metrics": fake.num_metrics})

    async def set_next(request: Request) -> Response:  # fault injection: the next call of a path, once
        body = await request.json()
        fake.next_answers[body["path"]] = body
        return JSONResponse({"ok": True})

    async def faults(scope: Any, receive: Any, send: Any) -> None:
        """An answer set with ``POST /_fake/next``: the call done at once but answered ``delay_s`` later (as a
        busy SGLang answers late), or ``status`` and ``raw`` instead of its answer (a broken SGLang, a proxy)."""
        fault = fake.next_answers.pop(scope["path"], None) if scope["type"] == "http" else None
        if fault is not None and "load_fails" in fault:
            fake.load_fault = fault
        if fault is not None and fault.get("delay_s"):
            async def late_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    await asyncio.sleep(fault["delay_s"])
                await send(message)

            await app(scope, receive, late_send)
            return
        if fault is not None and "raw" in fault:
            fake.calls.append(scope["path"].strip("/") + " (faulted)")
            await Response(fault["raw"], status_code=fault.get("status", 200),
                           media_type=fault.get("content_type", "text/plain"))(scope, receive, send)
            return
        await app(scope, receive, send)

    app = Starlette(routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/release_memory_occupation", release, methods=["GET", "POST"]),
        Route("/resume_memory_occupation", resume, methods=["GET", "POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/update_weights_from_tensor", weight_update, methods=["POST"]),
        Route("/update_weights_from_distributed", weight_update, methods=["POST"]),
        Route("/init_weights_update_group", weight_call, methods=["POST"]),
        Route("/destroy_weights_update_group", weight_call, methods=["POST"]),
        Route("/begin_weight_update", weight_call, methods=["POST"]),
        Route("/end_weight_update", weight_call, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/weights_checker", weights_checker, methods=["GET", "POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/ping", ping, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/_fake/metrics", set_metrics, methods=["POST"]),
        Route("/_fake/next", set_next, methods=["POST"]),
        Route("/_fake/state", fake_state, methods=["GET"]),
    ])
    return faults


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.sglang_fake")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--tag-mib", type=int, default=32, help="bytes each tag holds, in MiB")
    parser.add_argument("--model-path", default="/models/fake-sglang")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--weight-version", default="default", help="SGLang's --weight-version")
    parser.add_argument("--api-key", help="SGLang's --api-key: reported in /get_server_info, not checked")
    parser.add_argument("--admin-api-key", help="SGLang's --admin-api-key: reported, not checked")
    parser.add_argument("--server-info-extra", type=json.loads, default={},
                        help="a JSON object of fields /get_server_info answers besides its own")
    add_server_args(parser, default_host="127.0.0.1", default_port=0)
    args = parser.parse_args()
    fake = FakeSglang(enable_memory_saver=args.enable_memory_saver,
                      enable_weights_cpu_backup=args.enable_weights_cpu_backup, tag_bytes=args.tag_mib << 20,
                      model_path=args.model_path, tp_size=args.tp_size, weight_version=args.weight_version,
                      api_key=args.api_key, admin_api_key=args.admin_api_key, launch_command=" ".join(sys.argv[1:]),
                      server_info_extra=args.server_info_extra)
    serve(create_app(fake), host=args.host, port=args.port, port_file=args.port_file,
          header_timeout_s=args.header_timeout)


if __name__ == "__main__":
    main()
