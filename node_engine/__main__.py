"""``python -m node_engine``: load a model and serve it (SPEC section 5)."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys

from handoff.service.flag_types import path, positive_int, positive_seconds
from handoff.service.limits import DEFAULT_MAX_BODY_BYTES
from handoff.service.logs import setup_logging
from handoff.service.serve import (
    add_server_args,
    check_server_args,
    exit_on_sigterm,
    reserve_socket,
    serve_from_args,
)
from node_engine.config import ConfigError, EngineConfig
from node_engine.memory.cgroup_memory import host_memory
from node_engine.memory.tags import BackupMode
from node_engine.model.arch import ModelConfigError
from node_engine.vision.decode import DEFAULT_MAX_IMAGE_PIXELS

log = logging.getLogger("node_engine")


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m node_engine``."""
    p = argparse.ArgumentParser(prog="python -m node_engine", description="handoff LLM engine")
    p.add_argument("--model-path", required=True, help="a Hugging Face model folder, or builtin:tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the built-in model's weights")
    p.add_argument("--model-override", default=None,
                   help='JSON object overriding a built-in model\'s shape, e.g. {"hidden_size": 1024}')
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per prefill step (chunk size)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="SGLang's: larger admits fewer requests at once (fewer retractions); see docs/memory.md")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="allow /release_memory_occupation and /resume_memory_occupation")
    p.add_argument("--weights-backup", choices=[m.value for m in BackupMode], default="none")
    p.add_argument("--backup-dir", type=path, default=None, help="where weight backups are spilled (CPU/disk)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="CPU: run decode through torch.compile, compiled at start (needs a C++ compiler)")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not keep finished requests' KV for reuse by later requests with the same prefix")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream events carry only the new text, ids and logprobs (default: the whole answer so "
                        "far, as SGLang streams by default)")
    p.add_argument("--sampling-defaults", choices=("model", "openai"), default="model",
                   help="what a chat request that leaves out temperature, top_p, top_k, min_p or "
                        "repetition_penalty gets: the model's generation_config.json values (default, as SGLang), "
                        "or the OpenAI defaults")
    p.add_argument("--return-original-logprob", action="store_true",
                   help="output logprobs from the logits before the temperature is applied (default: after, as "
                        "SGLang; its SGLANG_RETURN_ORIGINAL_LOGPROB)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=32)
    p.add_argument("--mem-fraction", type=float, default=0.85, help="share of free GPU memory for the KV pool")
    p.add_argument("--num-threads", type=_thread_count, default=None,
                   help="CPU threads for torch (default on CPU: torch's default minus one, at least 1)")
    p.add_argument("--role", default="mixed", help="only mixed is available today")
    p.add_argument("--free-memory-override-file", type=path, default=None,
                   help="testing hook: free bytes for the resume check are read from this file when it exists")
    p.add_argument("--fault-drill-file", type=path, default=None,
                   help="fault drill: a one-shot fault written to this file as JSON fails the next matching step "
                        "or control call (docs/reliability.md); never for production")
    p.add_argument("--reload-timeout", type=positive_seconds, default=300.0,
                   help="seconds a reload may spend waiting for another weight update and reading its checkpoint; "
                        "past it: 504, the old weights serve")
    p.add_argument("--weight-sync-timeout", type=positive_seconds, default=300.0,
                   help="seconds a weight group join, or one update's wait for another update and its broadcasts "
                        "or payload decode, may take")
    p.add_argument("--health-step-timeout", type=positive_seconds, default=300.0,
                   help="seconds one model step may run before /health answers 503, so that a liveness probe "
                        "restarts an engine whose step hangs (a collective or a device that never returns)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body (images travel base64 in it; the sidecar's and LB's default too)")
    vision = p.add_argument_group("vision-language models")
    vision.add_argument("--max-image-tokens", type=int, default=None,
                        help="most tokens one image becomes (after the merge); the image processor is clamped so "
                             "every image is resized to fit (default: --max-batch-tokens)")
    vision.add_argument("--visual-batch-max-tokens", type=int, default=None,
                        help="image tokens the vision tower encodes per step; the first image of a step is always "
                             "admitted (default: --max-batch-tokens; 0: no limit)")
    vision.add_argument("--vision-reserve-mb", type=int, default=None,
                        help="reserve this much for the vision tower instead of measuring the worst case at start")
    vision.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="most decoded pixels of one image; more is refused before decoding (decompression "
                             "bombs)")
    vision.add_argument("--allowed-local-media-path", type=path, default=None,
                        help="image_data may name files below this folder (default: no local file is read)")
    p.add_argument("--memory-budget-mb", type=_memory_mb, default=None,
                   help="CPU: the most resident memory the engine may use; the KV pool is sized from it by "
                        "measuring peaks (default: a fixed pool, see --max-total-tokens)")
    add_server_args(p, default_host="127.0.0.1", default_port=30000)
    return p


def _thread_count(text: str) -> int:
    """1 to this machine's CPUs: 0 meant the default without a word, and OpenMP crashes (SIGSEGV) when asked
    for tens of thousands."""
    value = positive_int(text)
    cpus = os.cpu_count() or 1
    if value > cpus:
        raise argparse.ArgumentTypeError(f"at most this machine's {cpus} CPUs, got {text!r}")
    return value


def _seed(text: str) -> int:
    """What torch's generator takes: a whole number of 64 bits (past it, a traceback as the weights were made)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, got {text!r}") from None
    if not -(1 << 63) <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"a whole number of 64 bits, -2**63 to 2**64-1, got {text[:40]!r}")
    return value


def _memory_mb(text: str) -> int:
    """1 to the memory this process may hold, in MiB: the machine's, within its container's memory cgroup limit.
    A budget past it sized a KV pool the machine cannot hold (an int64 overflow, a traceback, for a huge one), or
    one whose pages, touched, got the process killed by the cgroup's OOM killer without a word."""
    value = positive_int(text)
    total_mb = host_memory().total_bytes // (1 << 20)
    if value > total_mb:
        raise argparse.ArgumentTypeError(f"at most this machine's memory within its container's limit ({total_mb} "
                                         f"MiB), got {text[:40]!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    setup_logging("node_engine", fmt=args.log_format, level=args.log_level)
    check_server_args(args)
    exit_on_sigterm()  # loading a model takes minutes; a pod deleted meanwhile must not wait its grace period
    # numpy imported here, not by torch's import: that loads it from C code which takes any exception there (a
    # SIGTERM's SystemExit included) for a failed import and goes on, and the engine then loaded and served
    importlib.import_module("numpy")
    try:
        config = EngineConfig(
            model_path=args.model_path, device=args.device, dtype=args.dtype, seed=args.seed,
            max_total_tokens=args.max_total_tokens, max_batch_tokens=args.max_batch_tokens,
            max_running_requests=args.max_running_requests, context_length=args.context_length,
            schedule_conservativeness=args.schedule_conservativeness,
            enable_memory_saver=args.enable_memory_saver, weights_backup=BackupMode(args.weights_backup),
            backup_dir=args.backup_dir, disable_cuda_graph=args.disable_cuda_graph,
            enable_torch_compile=args.enable_torch_compile,
            cuda_graph_max_bs=args.cuda_graph_max_bs, mem_fraction=args.mem_fraction,
            model_override=args.model_override, served_model_name=args.served_model_name,
            weight_version=args.weight_version, free_memory_override_file=args.free_memory_override_file,
            fault_drill_file=args.fault_drill_file,
            reload_timeout=args.reload_timeout,
            weight_sync_timeout=args.weight_sync_timeout, health_step_timeout=args.health_step_timeout,
            role=args.role, enable_prefix_cache=not args.disable_prefix_cache,
            max_image_tokens=args.max_image_tokens, visual_batch_max_tokens=args.visual_batch_max_tokens,
            vision_reserve_mb=args.vision_reserve_mb, memory_budget_mb=args.memory_budget_mb,
            max_image_pixels=args.max_image_pixels, allowed_local_media_path=args.allowed_local_media_path,
            incremental_streaming_output=args.incremental_streaming_output,
            sampling_defaults=args.sampling_defaults,
            return_original_logprob=args.return_original_logprob)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    if config.device == "cuda" and config.weights_backup is BackupMode.CPU and config.backup_dir is not None:
        log.warning("--backup-dir %s is not used: a CUDA engine's --weights-backup cpu is held in pinned host "
                    "memory (--weights-backup disk writes there)", config.backup_dir)
    if config.device == "cuda" and config.enable_memory_saver:
        from node_engine.launch import StartError, ensure_memory_saver_preload

        try:
            ensure_memory_saver_preload(argv)
        except StartError as exc:
            log.error("cannot start: %s", exc)
            return 2
    # the address is had before the model loads (minutes, and the device memory, for a real one): one in use is
    # refused at once; nothing listens on it until the engine serves
    reserved = reserve_socket(args.host, args.port)
    import torch

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    elif config.device == "cpu":
        # Leave a core to the HTTP thread: the two contend for the GIL and the cores (measured in bench/).
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    if config.device == "cuda" and not torch.cuda.is_available():
        log.error("--device cuda but CUDA is not available")
        reserved.close()
        return 2
    from node_engine.engine import Engine
    from node_engine.failures import exit_process
    from node_engine.server.app import create_app

    try:
        engine = Engine(config, on_fatal=exit_process)
    except (ConfigError, ModelConfigError) as exc:
        log.error("cannot start: %s", exc)
        reserved.close()
        return 2
    serve_from_args(create_app(engine, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout), args,
                    reserved=reserved)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        gc.freeze()  # however it ends: the exit frees torch's objects whole, not each through the collector (~0.4 s)
