"""``python -m lb``: the command line of the load balancer (SPEC section 5)."""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from handoff.service.auth import token_from
from handoff.service.flag_types import positive_int, positive_seconds
from handoff.service.limits import DEFAULT_MAX_BODY_BYTES
from handoff.service.logs import setup_logging
from handoff.service.serve import add_server_args, serve_from_args
from lb.addresses import Resolver
from lb.answer_budget import DEFAULT_MAX_BUFFERED_ANSWER_BYTES
from lb.app import create_app
from handoff.service.limits import DEFAULT_MAX_ANSWER_BYTES
from lb.config import DEFAULT_MAX_NODES, DnsTarget, LBConfig, NodeSpec, Policy, Role

log = logging.getLogger("lb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lb", description="handoff control-plane load balancer")
    add_server_args(parser, default_host="0.0.0.0", default_port=8080)
    nodes = parser.add_argument_group("nodes")
    nodes.add_argument("--node", action="append", default=[], metavar="URL", help="a mixed node (repeatable)")
    nodes.add_argument("--prefill", action="append", default=[], metavar="URL[@BOOTSTRAP_PORT]",
                       help="a prefill node and its PD bootstrap port (repeatable)")
    nodes.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode node (repeatable)")
    nodes.add_argument("--discover-dns", action="append", default=[], metavar="ROLE=HOST:PORT",
                       help="every address of HOST is a ROLE node on PORT (repeatable; prefill may add @PORT)")
    nodes.add_argument("--max-nodes", type=positive_int, default=DEFAULT_MAX_NODES, metavar="N",
                       help="the most members the LB holds: POST /nodes past it is 409 too_many_nodes, DNS "
                            f"discovery leaves the rest out (default {DEFAULT_MAX_NODES})")
    nodes.add_argument("--discover-interval", type=positive_seconds, default=10.0, metavar="S",
                       help="seconds between DNS lookups (default 10)")
    routing = parser.add_argument_group("routing and timeouts")
    routing.add_argument("--policy", choices=[p.value for p in Policy], default=Policy.LEAST_INFLIGHT.value,
                         help="how generation picks a node of a role (default least_inflight)")
    routing.add_argument("--control-timeout", type=positive_seconds, default=120.0, metavar="S",
                         help="per-node deadline of a control fan-out (default 120)")
    routing.add_argument("--weight-sync-timeout", type=positive_seconds, default=600.0, metavar="S",
                         help="per-node deadline of a weight group join, tensor push, broadcast update or disk "
                              "reload (default 600; ?timeout= overrides)")
    routing.add_argument("--max-control-timeout", type=positive_seconds, default=3600.0, metavar="S",
                         help="the largest ?timeout= a caller may ask for (default 3600)")
    routing.add_argument("--generate-timeout", type=positive_seconds, default=3600.0, metavar="S",
                         help="deadline of one generation request, stream included (default 3600)")
    routing.add_argument("--connect-timeout", type=positive_seconds, default=5.0, metavar="S",
                         help="deadline of opening a connection to a node; past it the node counts as unreachable "
                              "(a generation request moves to another node) (default 5)")
    routing.add_argument("--health-interval", type=positive_seconds, default=2.0, metavar="S",
                         help="seconds between two health checks of every node (default 2)")
    routing.add_argument("--health-timeout", type=positive_seconds, default=2.0, metavar="S",
                         help="deadline of one health check (default 2)")
    routing.add_argument("--unhealthy-threshold", type=int, default=2, metavar="N",
                         help="failed checks in a row that make a node unhealthy (default 2)")
    routing.add_argument("--healthy-threshold", type=int, default=1, metavar="N",
                         help="good checks in a row that make it healthy again (default 1)")
    security = parser.add_argument_group("security and limits")
    security.add_argument("--admin-token", default=None,
                          help="bearer token for control and membership (or HANDOFF_ADMIN_TOKEN); "
                               "also sent to the nodes")
    security.add_argument("--api-key", default=None, help="bearer token for generation (or HANDOFF_API_KEY)")
    security.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                          help="larger request bodies get 413 (default 64 MiB)")
    security.add_argument("--max-answer-bytes", type=int, default=DEFAULT_MAX_ANSWER_BYTES, metavar="N",
                          help="a node's non-stream generation answer larger than this is a 502 (streams are "
                               "relayed as they come and are not limited) (default 256 MiB)")
    security.add_argument("--max-buffered-answer-bytes", type=int, default=DEFAULT_MAX_BUFFERED_ANSWER_BYTES,
                          metavar="N", help="the non-stream answers all requests may have the LB hold at once; past "
                                            "it 503 overloaded (default 1 GiB; at least --max-answer-bytes)")
    return parser


def config_from_args(args: argparse.Namespace) -> LBConfig:
    """Raises ``ValueError`` naming the bad flag value."""
    specs = [NodeSpec.parse(url, Role.MIXED) for url in args.node]
    specs += [NodeSpec.parse(url, Role.PREFILL) for url in args.prefill]
    specs += [NodeSpec.parse(url, Role.DECODE) for url in args.decode]
    return LBConfig(
        nodes=tuple(specs),
        discover_dns=tuple(DnsTarget.parse(text) for text in args.discover_dns),
        discover_interval_s=args.discover_interval,
        policy=Policy(args.policy),
        control_timeout_s=args.control_timeout,
        weight_sync_timeout_s=args.weight_sync_timeout,
        max_control_timeout_s=args.max_control_timeout,
        generate_timeout_s=args.generate_timeout,
        connect_timeout_s=args.connect_timeout,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        unhealthy_threshold=args.unhealthy_threshold,
        healthy_threshold=args.healthy_threshold,
        max_nodes=args.max_nodes,
        max_body_bytes=args.max_body_bytes,
        max_answer_bytes=args.max_answer_bytes,
        max_buffered_answer_bytes=args.max_buffered_answer_bytes,
        body_timeout_s=args.body_timeout,
        admin_token=token_from(args.admin_token, "HANDOFF_ADMIN_TOKEN", "--admin-token"),
        api_key=token_from(args.api_key, "HANDOFF_API_KEY", "--api-key"),
    )


def main(argv: Sequence[str] | None = None, *, resolver: Resolver | None = None) -> None:
    """Parse flags and serve until SIGTERM; ``resolver`` replaces DNS (tests)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging("lb", fmt=args.log_format, level=args.log_level,
                  secrets=[s for s in (config.admin_token, config.api_key) if s])
    log.info("starting: %r", config)
    if config.admin_token is None and config.api_key is None:
        log.warning("no --admin-token: control calls (release, reload, membership) are open to anyone who can "
                    "reach this port")
    elif config.admin_token is None:
        log.warning("no --admin-token: control calls (release, reload, membership) take the --api-key, as "
                    "SGLang's do")
    serve_from_args(create_app(config, resolver=resolver), args, freeze_startup_objects=True)


if __name__ == "__main__":
    main()
