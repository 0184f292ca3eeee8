"""Benchmark of the load balancer (issues 5 and 13), each figure beside a baseline measured in the same run.

    .venv/bin/python bench/lb_bench.py [--requests 3000] [--rounds 60] [--concurrency 8] [--repeat 5]
                                       [--routers handoff,sglang-router,vllm-router] [--cases generation,fanout]

Fake nodes (``bench/lb_nodes.py``: uvloop + httptools, in a separate process)
stand behind real router processes (``bench/routers.py``: ``python -m lb``,
and sglang-router and vllm-router where installed, ``pip install -e .[bench]``);
this process is the client. Each figure is the median of ``--repeat`` runs.

Generation: CPU (user + system of the router process, all threads, psutil)
per proxied ``/generate``, non-stream and a 16-chunk stream, ``--concurrency``
requests in flight, through each router in front of the same fake nodes: mixed
(regular) mode with one and with two workers, and PD mode (handoff and
sglang-router speak SGLang's protocol, prefill and decode called at once;
vllm-router vLLM's, prefill then decode). Target: handoff's CPU per request no
higher than either router's. Beside each, the latency of the same node calls
made directly. One more PD row: a stream whose chunks come 1 ms apart (each
chunk then crosses the LB on its own).

Fan-out: ``POST /release_memory_occupation`` and ``POST /flush_cache`` to 128
nodes answering at once or after 20 ms. "overhead" is the LB's p50 minus one
node's p50 answering the same call directly: what a caller feels, who would
otherwise send one request to one node. Beside it, the same 128 calls made
directly by the client in parallel (same client code). The release also goes
to 128 nodes whose answers carry no state header, so the LB asks each for its
state once more (what the header saves); and sglang-router's and vllm-router's
``/flush_cache`` to the same 128 instant nodes. Every call of every fan-out
case and baseline is interleaved round by round, so all see the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import call, timed_calls  # noqa: E402
from bench.lb_nodes import DECODE_ANSWER, NUM_STREAM_CHUNKS, FakeNodes, NodeSpec  # noqa: E402
from bench.routers import HANDOFF, SGLANG_ROUTER, VLLM_ROUTER, Router, is_installed, start_router  # noqa: E402
from handoff.service.upstream import UpstreamClient  # noqa: E402

NUM_FANOUT_NODES = 128
INSTANT_OVERHEAD_TARGET_MS = 6.0
SLOW_OVERHEAD_TARGET_MS = 10.0
PD_CPU_TARGETS_MS = {False: 0.25, True: 0.45}  # issue 5: LB CPU per PD /generate, non-stream and streamed
REQUEST = json.dumps({"text": "The quick brown fox jumps over the lazy dog", "sampling_params":
                      {"max_new_tokens": 16, "temperature": 0}}).encode()
STREAM_REQUEST = json.dumps({**json.loads(REQUEST), "stream": True}).encode()
RELEASE_BODY = b'{"tags": ["weights", "kv_cache"]}'
RELEASE, FLUSH = "/release_memory_occupation", "/flush_cache"


@dataclass
class Row:
    case: str
    router: str
    figures: dict[str, float]
    target: str = "-"


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def p50_ms(latencies: list[float]) -> float:
    return statistics.median(latencies) * 1000


# -- generation ---------------------------------------------------------------------------

def check_generation(answer: bytes, is_stream: bool) -> None:
    """The decode node's completion, whole: each router may re-frame it, none may lose any of it."""
    if is_stream:
        if answer.count(b"data:") != NUM_STREAM_CHUNKS + 1 or b"[DONE]" not in answer:
            raise RuntimeError(f"a stream came back incomplete: {answer[:300]!r}")
    elif json.loads(answer) != json.loads(DECODE_ANSWER):
        raise RuntimeError(f"an answer is not the decode node's: {answer[:300]!r}")


async def measure_router(client: UpstreamClient, router: Router, body: bytes, num_requests: int,
                         concurrency: int) -> dict[str, float]:
    is_stream = body is STREAM_REQUEST

    async def one() -> None:
        check_generation(await call(client, "POST", router.url + "/generate", body, timeout=30), is_stream)

    await timed_calls(one, 300, concurrency)  # warm-up: connections, caches
    cpu_before = router.cpu_seconds()
    latencies = await timed_calls(one, num_requests, concurrency)
    return {"cpu_ms": (router.cpu_seconds() - cpu_before) / num_requests * 1000, "p50": p50_ms(latencies)}


async def measure_direct(direct: Callable[[], Awaitable[Any]], num_requests: int, concurrency: int) -> float:
    await timed_calls(direct, 300, concurrency)
    return p50_ms(await timed_calls(direct, num_requests, concurrency))


@dataclass
class Topology:
    name: str
    nodes: dict[str, Any]  # start_router's keywords
    direct: Callable[[bytes], Awaitable[Any]]  # the node calls one request makes, made by the client


async def bench_topology(client: UpstreamClient, topology: Topology, names: list[str],
                         args: argparse.Namespace) -> list[Row]:
    runs: dict[tuple[bool, str], list[dict[str, float]]] = {}
    async with started(names, **topology.nodes) as routers:
        for _ in range(args.repeat):
            for body in (REQUEST, STREAM_REQUEST):
                is_stream = body is STREAM_REQUEST
                for router in routers:  # one after the other, run after run: each sees the same machine
                    runs.setdefault((is_stream, router.name), []).append(
                        await measure_router(client, router, body, args.requests, args.concurrency))
                direct_p50 = await measure_direct(lambda b=body: topology.direct(b), args.requests,
                                                  args.concurrency)
                runs.setdefault((is_stream, "direct"), []).append({"p50": direct_p50})
    rows = []
    for is_stream in (False, True):
        case = f"{topology.name}, {'stream of 16 chunks' if is_stream else 'non-stream'}"
        figures = {name: median_of(runs[(is_stream, name)]) for name in names}
        direct_p50 = median_of(runs[(is_stream, "direct")])["p50"]
        for name in names:
            rows.append(Row(case, name, {**figures[name], "direct_p50": direct_p50},
                            generation_target(topology.name, is_stream, name, figures)))
    return rows


def generation_target(topology: str, is_stream: bool, name: str, figures: dict[str, dict[str, float]]) -> str:
    if name != HANDOFF:
        return "-"
    parts = []
    rivals = [figures[rival]["cpu_ms"] for rival in figures if rival != HANDOFF]
    if rivals:
        met = figures[HANDOFF]["cpu_ms"] <= min(rivals)
        parts.append(f"CPU <= rivals' ({'met' if met else 'MISSED'})")
    if topology == "PD":
        limit = PD_CPU_TARGETS_MS[is_stream]
        parts.append(f"CPU <= {limit} ms ({'met' if figures[HANDOFF]['cpu_ms'] <= limit else 'MISSED'})")
    return "; ".join(parts) or "-"


@contextlib.asynccontextmanager
async def started(names: list[str], **nodes: Any) -> Any:
    routers: list[Router] = []
    try:
        for name in names:
            routers.append(await asyncio.to_thread(start_router, name, **nodes))
        yield routers
    finally:
        for router in routers:
            router.stop()


async def bench_generation(client: UpstreamClient, nodes: FakeNodes, names: list[str],
                           args: argparse.Namespace) -> list[Row]:
    prefill, (worker, second_worker), paced = nodes.of("prefill")[0], nodes.of("decode"), nodes.of("decode_paced")[0]
    turn = iter(range(1 << 62))

    def both_pd(body: bytes, decode: str = worker) -> Awaitable[Any]:
        return asyncio.gather(call(client, "POST", prefill + "/generate", body),
                              call(client, "POST", decode + "/generate", body))

    topologies = [
        Topology("mixed, 1 worker", {"workers": [worker]}, lambda body: call(client, "POST", worker + "/generate", body)),
        Topology("mixed, 2 workers", {"workers": [worker, second_worker]}, lambda body: call(
            client, "POST", (worker, second_worker)[next(turn) % 2] + "/generate", body)),
        Topology("PD", {"prefill": prefill, "decode": worker}, both_pd),
    ]
    rows = []
    for topology in topologies:
        rows += await bench_topology(client, topology, names, args)
    runs = []
    async with started([HANDOFF], prefill=prefill, decode=paced) as (lb,):
        for _ in range(args.repeat):
            figures = await measure_router(client, lb, STREAM_REQUEST, args.requests // 2, args.concurrency)
            direct_p50 = await measure_direct(lambda: both_pd(STREAM_REQUEST, paced), args.requests // 2,
                                              args.concurrency)
            runs.append({**figures, "direct_p50": direct_p50})
    rows.append(Row("PD, stream, chunks 1 ms apart", HANDOFF, median_of(runs)))
    return rows


# -- fan-out ------------------------------------------------------------------------------

@dataclass
class FanoutCase:
    label: str
    router: Router
    path: str
    nodes: list[str]
    target_ms: float | None
    check: Callable[[bytes], None]
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0


def fanout_body(path: str) -> bytes:
    return RELEASE_BODY if path == RELEASE else b""


def answered_by_all(name: str, num_nodes: int) -> Callable[[bytes], None]:
    """What each router says when every node answered: handoff and sglang-router count them."""
    def check(answer: bytes) -> None:
        if name == HANDOFF:
            ok = json.loads(answer).get("total") == num_nodes
        elif name == SGLANG_ROUTER:
            ok = json.loads(answer).get("workers_flushed") == num_nodes
        else:
            ok = answer.startswith(b"Cache flushed")
        if not ok:
            raise RuntimeError(f"{name} did not reach all {num_nodes} nodes: {answer[:300]!r}")
    return check


async def fanout_call(client: UpstreamClient, case: FanoutCase) -> None:
    case.check(await call(client, "POST", case.router.url + case.path, fanout_body(case.path), timeout=30))


async def warm_up(client: UpstreamClient, case: FanoutCase) -> None:
    """A few calls; a router may still be registering its workers (sglang-router does after it listens)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            for _ in range(5):
                await fanout_call(client, case)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def bench_fanout_once(client: UpstreamClient, cases: list[FanoutCase], rounds: int) -> list[dict[str, float]]:
    baselines = sorted({(tuple(case.nodes), case.path) for case in cases})
    direct: dict[Any, list[float]] = {key: [] for key in baselines}
    single: dict[Any, list[float]] = {key: [] for key in baselines}
    for case in cases:
        case.latencies, case.cpu_s = [], 0.0
        await warm_up(client, case)
    for index in range(rounds):
        for case in cases:
            cpu_before = case.router.cpu_seconds()
            started_at = time.perf_counter()
            await fanout_call(client, case)
            case.latencies.append(time.perf_counter() - started_at)
            case.cpu_s += case.router.cpu_seconds() - cpu_before
        for nodes, path in baselines:
            body = fanout_body(path)
            started_at = time.perf_counter()
            await asyncio.gather(*(call(client, "POST", url + path, body) for url in nodes))
            direct[(nodes, path)].append(time.perf_counter() - started_at)
            for offset in range(3):
                started_at = time.perf_counter()
                await call(client, "POST", nodes[(3 * index + offset) % len(nodes)] + path, body)
                single[(nodes, path)].append(time.perf_counter() - started_at)
    return [{"cpu_ms": case.cpu_s / rounds * 1000, "lb_p50": p50_ms(case.latencies),
             "one_p50": p50_ms(single[(tuple(case.nodes), case.path)]),
             "direct_p50": p50_ms(direct[(tuple(case.nodes), case.path)])} for case in cases]


async def bench_fanout(client: UpstreamClient, nodes: FakeNodes, names: list[str],
                       args: argparse.Namespace) -> list[Row]:
    instant, slow = nodes.of("instant"), nodes.of("slow")
    stateless = nodes.of("instant", sends_state=False)
    n = NUM_FANOUT_NODES
    async with contextlib.AsyncExitStack() as stack:
        lb = {key: (await stack.enter_async_context(started([HANDOFF], workers=urls)))[0]
              for key, urls in (("instant", instant), ("slow", slow), ("stateless", stateless))}
        check = answered_by_all(HANDOFF, n)
        cases = [
            FanoutCase(f"release, {n} instant nodes", lb["instant"], RELEASE, instant, INSTANT_OVERHEAD_TARGET_MS, check),
            FanoutCase(f"release, {n} instant nodes, no state header", lb["stateless"], RELEASE, stateless, None, check),
            FanoutCase(f"release, {n} nodes at 20 ms", lb["slow"], RELEASE, slow, SLOW_OVERHEAD_TARGET_MS, check),
            FanoutCase(f"flush_cache, {n} instant nodes", lb["instant"], FLUSH, instant, INSTANT_OVERHEAD_TARGET_MS,
                       check),
            FanoutCase(f"flush_cache, {n} nodes at 20 ms", lb["slow"], FLUSH, slow, SLOW_OVERHEAD_TARGET_MS, check),
        ]
        for name in names:
            if name != HANDOFF:
                (rival,) = await stack.enter_async_context(started([name], workers=instant))
                cases.append(FanoutCase(f"flush_cache, {n} instant nodes", rival, FLUSH, instant, None,
                                        answered_by_all(name, n)))
        runs = [await bench_fanout_once(client, cases, args.rounds) for _ in range(args.repeat)]
    rows = []
    for index, case in enumerate(cases):
        figures = median_of([run[index] for run in runs])
        figures["overhead"] = figures["lb_p50"] - figures["one_p50"]
        target = "-"
        if case.target_ms is not None:
            target = f"overhead <= {case.target_ms:g} ms ({'met' if figures['overhead'] <= case.target_ms else 'MISSED'})"
        rows.append(Row(case.label, case.router.name, figures, target))
    return rows


# -- output -------------------------------------------------------------------------------

def print_table(columns: list[tuple[str, Callable[[Row], str]]], rows: list[Row]) -> None:
    if not rows:
        return
    cells = [[render(row) for _, render in columns] for row in rows]
    widths = [max(len(title), *(len(line[i]) for line in cells)) for i, (title, _) in enumerate(columns)]
    print("| " + " | ".join(title.ljust(w) for (title, _), w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in cells:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |")
    print()


def ms(key: str, digits: int = 2) -> Callable[[Row], str]:
    return lambda row: f"{row.figures[key]:.{digits}f} ms" if key in row.figures else "-"


def print_report(generation: list[Row], fanout: list[Row]) -> None:
    handoff_cpu = {row.case: row.figures["cpu_ms"] for row in generation if row.router == HANDOFF}
    print_table([("case", lambda r: r.case), ("router", lambda r: r.router), ("CPU/request", ms("cpu_ms", 3)),
                 ("vs handoff", lambda r: f"{r.figures['cpu_ms'] / handoff_cpu[r.case]:.2f}x"),
                 ("p50", ms("p50")), ("direct p50", ms("direct_p50")), ("target", lambda r: r.target)], generation)
    print_table([("case", lambda r: r.case), ("router", lambda r: r.router), ("CPU/call", ms("cpu_ms", 3)),
                 ("p50", ms("lb_p50")), ("one node p50", ms("one_p50")), ("overhead p50", ms("overhead")),
                 ("direct fan-out p50", ms("direct_p50")),
                 ("vs direct fan-out", lambda r: f"{r.figures['lb_p50'] - r.figures['direct_p50']:+.2f} ms"),
                 ("target", lambda r: r.target)], fanout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="generation requests per case and run")
    parser.add_argument("--rounds", type=int, default=60, help="fan-out rounds per run")
    parser.add_argument("--concurrency", type=int, default=8, help="generation requests in flight at once")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case; each figure is their median")
    parser.add_argument("--routers", default=f"{HANDOFF},{SGLANG_ROUTER},{VLLM_ROUTER}",
                        help="comma-separated; handoff is always measured")
    parser.add_argument("--cases", default="generation,fanout", help="comma-separated: generation, fanout")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    if not cases or not cases <= {"generation", "fanout"}:
        parser.error(f"--cases takes generation and/or fanout, got {args.cases!r}")
    names = [HANDOFF]
    for name in args.routers.split(","):
        if name in (SGLANG_ROUTER, VLLM_ROUTER):
            if is_installed(name):
                names.append(name)
            else:
                print(f"{name} is not installed (pip install -e '.[bench]'): skipped")
        elif name != HANDOFF:
            parser.error(f"unknown router {name!r}")
    print(f"targets: fan-out overhead p50 (LB p50 - one node's p50) <= {INSTANT_OVERHEAD_TARGET_MS:g} ms to "
          f"{NUM_FANOUT_NODES} instant nodes, <= {SLOW_OVERHEAD_TARGET_MS:g} ms to {NUM_FANOUT_NODES} nodes at 20 ms; "
          "handoff's CPU per proxied request <= each other router's; PD CPU <= 0.25 ms non-stream, <= 0.45 ms stream")
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    specs = ([NodeSpec("prefill"), NodeSpec("decode"), NodeSpec("decode"), NodeSpec("decode_paced")]
             + [NodeSpec("instant")] * NUM_FANOUT_NODES + [NodeSpec("slow")] * NUM_FANOUT_NODES
             + [NodeSpec("instant", sends_state=False)] * NUM_FANOUT_NODES)
    with FakeNodes(specs) as nodes:
        import uvloop

        async def run() -> tuple[list[Row], list[Row]]:
            client = UpstreamClient()
            try:
                return (await bench_generation(client, nodes, names, args) if "generation" in cases else [],
                        await bench_fanout(client, nodes, names, args) if "fanout" in cases else [])
            finally:
                await client.aclose()

        generation, fanout = uvloop.run(run())
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f} at the end")
    print_report(generation, fanout)


if __name__ == "__main__":
    main()
