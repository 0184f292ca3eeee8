"""Same-run A/B of two checkouts' LBs: CPU and latency of one call through each, on the same fake nodes.

    git worktree add --detach /tmp/base <commit>       # the checkout to compare with
    .venv/bin/python bench/lb_ab.py --base /tmp/base [--path /release_memory_occupation] [--nodes 128]
                                    [--behaviour instant] [--rounds 300] [--stream]

Two LB processes, ``python -m lb`` from ``--base`` (A) and from this checkout
(B), stand in front of the same fake nodes (``bench/lb_nodes.py``); their
calls alternate round by round (A first on even rounds, B first on odd ones),
so a busy or slow machine weighs on both alike. Printed: each LB's p50, p99,
slowest call and CPU per call (user + system of its process, psutil), and B/A
of p50 and CPU. For a change whose effect is smaller than the noise between separate benchmark runs
on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import call  # noqa: E402
from bench.lb_nodes import FakeNodes, NodeSpec  # noqa: E402
from bench.routers import process_cpu_seconds  # noqa: E402
from handoff.cluster.process import ServerProcess  # noqa: E402
from handoff.service.upstream import UpstreamClient  # noqa: E402

RELEASE_BODY = b'{"tags": ["weights", "kv_cache"]}'


def start_lb(checkout: Path, urls: list[str], name: str) -> ServerProcess:
    """``python -m lb`` of ``checkout`` (its directory first on the module path) in front of ``urls``."""
    args = [a for url in urls for a in ("--node", url)] + ["--log-level", "warning", "--health-interval", "60"]
    return ServerProcess("lb", args, log_dir=Path(tempfile.mkdtemp(prefix=f"bench-{name}-")), name=name,
                         cwd=checkout, env={"PYTHONPATH": str(checkout)}).start(timeout=120)


async def measure(lbs: dict[str, ServerProcess], path: str, body: bytes, rounds: int) -> dict[str, list[float]]:
    client = UpstreamClient()
    try:
        for lb in lbs.values():
            for _ in range(20):
                await call(client, "POST", lb.url + path, body, timeout=30)
        latencies: dict[str, list[float]] = {name: [] for name in lbs}
        cpu_s = dict.fromkeys(lbs, 0.0)
        for index in range(rounds):
            order = list(lbs) if index % 2 == 0 else list(reversed(lbs))
            for name in order:
                cpu_before, started = process_cpu_seconds(lbs[name].pid), time.perf_counter()
                await call(client, "POST", lbs[name].url + path, body, timeout=30)
                latencies[name].append(time.perf_counter() - started)
                cpu_s[name] += process_cpu_seconds(lbs[name].pid) - cpu_before
        # "inclusive": the default ("exclusive") extrapolates past the slowest call under 99 rounds
        return {name: [statistics.median(latencies[name]) * 1000, cpu_s[name] / rounds * 1000,
                       statistics.quantiles(latencies[name], n=100, method="inclusive")[98] * 1000,
                       max(latencies[name]) * 1000]
                for name in lbs}
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with (A)")
    parser.add_argument("--path", default="/release_memory_occupation")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--behaviour", default="instant", choices=["instant", "slow", "decode"])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--stream", action="store_true", help="a /generate streamed (16 SSE chunks from decode nodes)")
    args = parser.parse_args()
    if not (args.base / "lb" / "__main__.py").is_file():
        parser.error(f"--base {args.base} is not a checkout of this project")
    body = RELEASE_BODY if args.path == "/release_memory_occupation" else (
        b'{"text": "hi", "sampling_params": {"max_new_tokens": 16}' + (b', "stream": true}' if args.stream else b'}')
        if args.path == "/generate" else b"")
    here = REPO_ROOT
    with FakeNodes([NodeSpec(args.behaviour)] * args.nodes) as nodes:
        urls = nodes.of(args.behaviour)
        lbs = {"A": start_lb(args.base.resolve(), urls, "lb-a"), "B": start_lb(here, urls, "lb-b")}
        try:
            figures = uvloop.run(measure(lbs, args.path, body, args.rounds))
        finally:
            for lb in lbs.values():
                lb.stop()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, {args.nodes} {args.behaviour} nodes, "
          f"POST {args.path}{' (stream)' if args.stream else ''}, {args.rounds} rounds; A = {args.base}, B = {here}")
    for name, (p50_ms, cpu_ms, p99_ms, max_ms) in figures.items():
        print(f"{name}: p50 {p50_ms:.2f} ms, p99 {p99_ms:.2f} ms, max {max_ms:.2f} ms, CPU per call {cpu_ms:.2f} ms")
    (a_p50, a_cpu, _, _), (b_p50, b_cpu, _, _) = figures["A"], figures["B"]
    print(f"B/A: p50 {b_p50 / a_p50:.3f}, CPU {b_cpu / a_cpu:.3f}")


if __name__ == "__main__":
    main()
