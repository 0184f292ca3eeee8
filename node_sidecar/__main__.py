"""``python -m node_sidecar``: the door in front of one engine (SPEC section 3)."""

from __future__ import annotations

import argparse
import logging
import sys

from handoff.service.auth import token_from
from handoff.service.flag_types import path, positive_seconds, state_file
from handoff.service.limits import DEFAULT_MAX_ANSWER_BYTES, DEFAULT_MAX_BODY_BYTES
from handoff.service.logs import setup_logging
from handoff.service.serve import add_server_args, serve_from_args
from handoff.protocol.engines import ENGINE_KIND_NAMES
from node_sidecar.config import ROLES, ConfigError, SidecarConfig
from node_sidecar.intent_file import StateFileInUse, claim

log = logging.getLogger("node_sidecar")


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m node_sidecar``."""
    p = argparse.ArgumentParser(prog="python -m node_sidecar", description="handoff node sidecar")
    p.add_argument("--engine-url", required=True, help="the engine's URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--role", choices=ROLES, default="mixed")
    p.add_argument("--engine-kind", choices=ENGINE_KIND_NAMES, default=None,
                   help="the engine behind this sidecar (default: detected from its info endpoints)")
    p.add_argument("--vllm-sleep-level", type=int, choices=(1, 2), default=1,
                   help="vLLM: sleep level of a release without stage_to_cpu (1 keeps the weights in host memory, "
                        "2 discards them: the node then refuses generation until a reload)")
    p.add_argument("--vllm-weight-sync-timeout", type=positive_seconds, default=300.0,
                   help="vLLM: seconds a weight-group join, or one update's broadcasts, may take")
    p.add_argument("--admin-token", default=None, help="bearer token for control calls (or HANDOFF_ADMIN_TOKEN)")
    p.add_argument("--api-key", default=None, help="bearer token for generation (or HANDOFF_API_KEY)")
    p.add_argument("--hold-requests", action="store_true",
                   help="hold generation while not serving (bounded) instead of answering 503")
    p.add_argument("--hold-max", type=int, default=256)
    p.add_argument("--hold-timeout", type=positive_seconds, default=60.0)
    p.add_argument("--pause-hold-max", type=int, default=16384,
                   help="requests held at most while generation is paused or weights update (SGLang queues them)")
    p.add_argument("--pause-hold-timeout", type=positive_seconds, default=3600.0,
                   help="seconds each of them may wait (then 503)")
    p.add_argument("--hold-max-bytes", type=int, default=1 << 30,
                   help="bytes of request bodies held at once, paused or not (past it: 503) (default 1 GiB)")
    p.add_argument("--max-inflight-bytes", type=int, default=1 << 30, metavar="N",
                   help="bytes of generation bodies and buffered non-stream answers the running requests hold at "
                        "once; past it a new request is 503 overloaded with Retry-After (nothing sent to the "
                        "engine), an answer that would pass it a 502 (default 1 GiB; at least --max-body-bytes)")
    p.add_argument("--drain-timeout", type=positive_seconds, default=60.0, help="default drain bound of a release (s)")
    p.add_argument("--max-drain-timeout", type=positive_seconds, default=3600.0)
    p.add_argument("--generate-timeout", type=positive_seconds, default=3600.0)
    p.add_argument("--control-timeout", type=positive_seconds, default=600.0)
    p.add_argument("--engine-poll-interval", type=positive_seconds, default=1.0)
    p.add_argument("--engine-health-timeout", type=positive_seconds, default=5.0, help="one health probe's bound (s)")
    p.add_argument("--engine-health-misses", type=int, default=3,
                   help="health probes in a row that get no answer in time before the engine counts as down "
                        "(a refused connection, a dropped one or an error status count at once)")
    p.add_argument("--retry-after", type=int, default=2,
                   help="Retry-After seconds on the 503s of a node that does not serve")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 64 MiB)")
    p.add_argument("--max-answer-bytes", type=int, default=DEFAULT_MAX_ANSWER_BYTES, metavar="N",
                   help="an engine's non-stream answer larger than this is a 502 (streams are relayed as they "
                        "come and are not limited) (default 256 MiB)")
    p.add_argument("--allowed-local-media-path", type=path, default=None,
                   help="SGLang / vLLM engines: media items may name files below this folder (default: a local path "
                        "or file:// URL is a 400 at the sidecar)")
    p.add_argument("--refuse-media-urls", action="store_true",
                   help="SGLang / vLLM engines: an http(s) media URL is a 400 at the sidecar (default: passed on, "
                        "and the engine fetches it)")
    p.add_argument("--state-file", type=state_file, default=None, metavar="PATH",
                   help="keep what the cluster asked of the node (its releases, whether its weights were updated, "
                        "the weight groups joined, the engine process) in this file, so that a sidecar restarted "
                        "with its engine releases the fresh engine again and holds out stale weights (default: "
                        "kept in memory only; a restarted sidecar remembers nothing)")
    add_server_args(p, default_host="0.0.0.0", default_port=8080)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        admin_token = token_from(args.admin_token, "HANDOFF_ADMIN_TOKEN", "--admin-token")
        api_key = token_from(args.api_key, "HANDOFF_API_KEY", "--api-key")
    except ValueError as exc:
        print(f"node_sidecar: {exc}", file=sys.stderr)
        return 2
    setup_logging("node_sidecar", fmt=args.log_format, level=args.log_level,
                  secrets=[s for s in (admin_token, api_key) if s])
    try:
        config = SidecarConfig(
            engine_url=args.engine_url, role=args.role, engine_kind=args.engine_kind,
            vllm_sleep_level=args.vllm_sleep_level,
            vllm_weight_sync_timeout=args.vllm_weight_sync_timeout, admin_token=admin_token, api_key=api_key,
            hold_requests=args.hold_requests, hold_max=args.hold_max, hold_timeout=args.hold_timeout,
            pause_hold_max=args.pause_hold_max, pause_hold_timeout=args.pause_hold_timeout,
            hold_max_bytes=args.hold_max_bytes, max_inflight_bytes=args.max_inflight_bytes,
            drain_timeout=args.drain_timeout, max_drain_timeout=args.max_drain_timeout,
            generate_timeout=args.generate_timeout, control_timeout=args.control_timeout,
            engine_poll_interval=args.engine_poll_interval, engine_health_timeout=args.engine_health_timeout,
            engine_health_misses=args.engine_health_misses, retry_after_s=args.retry_after,
            max_body_bytes=args.max_body_bytes, max_answer_bytes=args.max_answer_bytes,
            body_timeout=args.body_timeout, allowed_local_media_path=args.allowed_local_media_path,
            refuse_media_urls=args.refuse_media_urls, state_file=args.state_file)
        if config.state_file is not None:
            claim(config.state_file)  # held for the process's life: the node's intent file takes it again
    except (ConfigError, StateFileInUse) as exc:
        log.error("%s", exc)
        return 2
    if admin_token is None and api_key is None:
        log.warning("no --admin-token: control calls (release, resume, reload) are open to anyone who can reach "
                    "this port")
    elif admin_token is None:
        log.warning("no --admin-token: control calls (release, resume, reload) take the --api-key, as SGLang's do")
    from node_sidecar.app import create_app

    serve_from_args(create_app(config), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
