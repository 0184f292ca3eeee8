"""Benchmark of the node sidecar (issue 4): CPU it adds per proxied request, and release start latency.

    .venv/bin/python bench/sidecar_overhead.py [--requests 3000] [--concurrency 1 16] [--repeats 5]
                                               [--cases non-stream stream paced]
                                               [--release-runs 100] [--release-streams 8] [--release-gap-ms 2]

Three processes on loopback: a fake engine (``bench/fake_engine.py``: raw
asyncio + httptools, answers at once), a real ``python -m node_sidecar`` in
front of it, and this process, the load generator (uvloop and the pooled
``UpstreamClient``, keep-alive connections).

1. Sidecar CPU per request: user + system CPU of the sidecar process (psutil)
   over ``--requests`` proxied ``POST /generate`` calls, divided by their
   number, at each ``--concurrency`` (requests in flight at once). Cases:
   non-stream; a stream of 16 SSE events written at once (they mostly cross
   the sidecar as one read); a stream of 16 events 1 ms apart (each event
   crosses the sidecar on its own; a tenth of ``--requests``, as each takes
   16 ms or more). Beside it, the client-side latency of the same requests
   through the sidecar and sent to the fake engine directly, in the same run,
   and the sidecar's CPU per request while the direct requests run (its
   background cost; it should be about zero). Every answer through the
   sidecar is checked byte for byte against the direct one.
2. Release start latency: ``--release-streams`` streams are held open in the
   fake engine; ``POST /release_memory_occupation {"mode": "wait"}`` goes to
   the sidecar; once its drain has started, the fake engine is told to end the
   streams (all in one turn of its loop, or ``--release-gap-ms`` apart). The
   latency is the fake engine's own clock from writing the last stream's final
   byte to receiving the sidecar's ``/release_memory_occupation``; each run
   checks that every stream ended with ``[DONE]`` and ``drained_requests``
   counts them all; the node is resumed between runs. Percentiles are
   nearest-rank over ``--release-runs`` runs per pattern.

Each figure of part 1 is the median over ``--repeats`` rounds (the cases run
interleaved in each round, so all see the same machine load). The sidecar is
started with ``--engine-poll-interval 60`` so its engine health poll (one
``GET /health`` per second by default) does not land in the per-request figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import MAX_ANSWER_BYTES, call, cpu_seconds, start_server, timed_calls  # noqa: E402
from handoff.cluster.process import ServerProcess  # noqa: E402
from handoff.service.upstream import UpstreamClient  # noqa: E402

CPU_TARGET_MS = 0.3
RELEASE_TARGET_MS = 20.0
NUM_STREAM_CHUNKS = 16
WARMUP_REQUESTS = 200
REQUEST = json.dumps({"text": "The quick brown fox jumps over the lazy dog",
                      "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).encode()
STREAM_REQUEST = json.dumps({**json.loads(REQUEST), "stream": True}).encode()
JSON_HEADERS = {"Content-Type": "application/json"}


# -- processes -------------------------------------------------------------------------------

# -- client helpers --------------------------------------------------------------------------

async def call_json(client: UpstreamClient, method: str, url: str, body: Any = None) -> Any:
    return json.loads(await call(client, method, url, b"" if body is None else json.dumps(body).encode()))


async def wait_ready(client: UpstreamClient, sidecar: ServerProcess) -> None:
    deadline = time.monotonic() + 30
    while True:
        response = await client.request("GET", sidecar.url + "/ready", timeout=5)
        await response.read_whole(MAX_ANSWER_BYTES)
        if response.status == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the sidecar did not become ready")
        await asyncio.sleep(0.02)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# -- part 1: CPU per request ---------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    key: str
    name: str
    body: bytes
    query: str
    concurrency: int
    share: float = 1.0  # of --requests: a paced stream takes 16+ ms, so it runs fewer


@dataclass
class CaseFigures:
    """One round of one case."""

    cpu_ms: float           # sidecar CPU per proxied request
    sys_ms: float           # of which in the kernel
    idle_cpu_ms: float      # sidecar CPU per request while the same requests go to the engine directly
    sidecar_p50_ms: float
    sidecar_p99_ms: float
    direct_p50_ms: float
    direct_p99_ms: float


async def measure_case(client: UpstreamClient, sidecar: ServerProcess, engine_url: str, case: Case,
                       num_requests: int, num_warmup: int) -> CaseFigures:
    via_url = f"{sidecar.url}/generate{case.query}"
    direct_url = f"{engine_url}/generate{case.query}"
    expected = await call(client, "POST", direct_url, case.body)

    async def via_sidecar() -> None:
        if await call(client, "POST", via_url, case.body) != expected:
            raise RuntimeError(f"{case.name}: the sidecar's answer differs from the engine's")

    async def direct() -> None:
        await call(client, "POST", direct_url, case.body)

    await timed_calls(via_sidecar, num_warmup, case.concurrency)
    before = psutil.Process(sidecar.pid).cpu_times()
    via = await timed_calls(via_sidecar, num_requests, case.concurrency)
    after = psutil.Process(sidecar.pid).cpu_times()
    cpu_ms = (after.user - before.user + after.system - before.system) / num_requests * 1000
    sys_ms = (after.system - before.system) / num_requests * 1000
    await timed_calls(direct, num_warmup, case.concurrency)
    cpu_before = cpu_seconds(sidecar)
    straight = await timed_calls(direct, num_requests, case.concurrency)
    idle_cpu_ms = (cpu_seconds(sidecar) - cpu_before) / num_requests * 1000
    return CaseFigures(cpu_ms, sys_ms, idle_cpu_ms, percentile(via, 50) * 1000, percentile(via, 99) * 1000,
                       percentile(straight, 50) * 1000, percentile(straight, 99) * 1000)


def median_figures(rounds: list[CaseFigures]) -> CaseFigures:
    return CaseFigures(*(statistics.median(getattr(r, name) for r in rounds)
                         for name in CaseFigures.__dataclass_fields__))


# -- part 2: release start latency ----------------------------------------------------------

async def release_once(client: UpstreamClient, sidecar: ServerProcess, engine_url: str, num_streams: int,
                       gap_ms: float) -> float:
    """One held-streams + wait-mode release run; the latency in ms on the fake engine's clock."""
    await call(client, "POST", engine_url + "/_bench/reset")
    responses = [await client.request("POST", sidecar.url + "/generate?hold=1", headers=JSON_HEADERS,
                                      body=STREAM_REQUEST, timeout=60) for _ in range(num_streams)]
    for response in responses:
        if response.status != 200:
            raise RuntimeError(f"a held stream answered {response.status}")
    firsts = [await response.next_chunk() for response in responses]  # each stream is relayed and running
    rests = [asyncio.ensure_future(response.read_whole(MAX_ANSWER_BYTES)) for response in responses]
    occupation = await call_json(client, "GET", sidecar.url + "/memory_occupation")
    if occupation["in_flight"] != num_streams:
        raise RuntimeError(f"expected {num_streams} streams in flight, the sidecar counts {occupation['in_flight']}")
    release = asyncio.ensure_future(call_json(client, "POST", sidecar.url + "/release_memory_occupation",
                                              {"mode": "wait"}))
    deadline = time.monotonic() + 10
    while (await call_json(client, "GET", sidecar.url + "/memory_occupation"))["admission"] != "closed":
        if time.monotonic() > deadline:
            raise RuntimeError("the release did not close admission")
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)  # the release is now waiting in its drain
    if release.done():
        raise RuntimeError(f"the release finished before the streams ended: {release.result()}")
    ended = await call_json(client, "POST", f"{engine_url}/_bench/end_streams?gap_ms={gap_ms:g}")
    if ended["ended"] != num_streams:
        raise RuntimeError(f"the fake engine ended {ended['ended']} streams, not {num_streams}")
    bodies = [first + await rest for first, rest in zip(firsts, rests)]
    answer = await release
    if any(not body.endswith(b"data: [DONE]\n\n") for body in bodies):
        raise RuntimeError("a drained stream did not end with [DONE]")
    if answer["drained_requests"] != num_streams or not answer["released"]:
        raise RuntimeError(f"unexpected release answer: {answer}")
    timings = await call_json(client, "GET", engine_url + "/_bench/timings")
    if len(timings["release_arrivals"]) != 1:
        raise RuntimeError(f"the engine saw {len(timings['release_arrivals'])} releases, not 1")
    latency_ms = (timings["release_arrivals"][0] - timings["last_held_end"]) * 1000
    if latency_ms < 0:
        raise RuntimeError("the release reached the engine before the last stream ended")
    await call_json(client, "POST", sidecar.url + "/resume_memory_occupation", {})
    await wait_ready(client, sidecar)
    return latency_ms


# -- running and printing --------------------------------------------------------------------

async def run(args: argparse.Namespace, sidecar: ServerProcess, engine: ServerProcess) -> tuple[dict[Case, CaseFigures],
                                                                                 dict[float, list[float]]]:
    client = UpstreamClient()
    try:
        await wait_ready(client, sidecar)
        cases = [case for c in args.concurrency for case in (
            Case("non-stream", "non-stream", REQUEST, "", c),
            Case("stream", f"stream, {NUM_STREAM_CHUNKS} events at once", STREAM_REQUEST, "", c),
            Case("paced", f"stream, {NUM_STREAM_CHUNKS} events 1 ms apart", STREAM_REQUEST, "?pace_ms=1", c, 0.1))
            if case.key in args.cases]
        rounds: dict[Case, list[CaseFigures]] = {case: [] for case in cases}
        for index in range(args.repeats):
            for case in cases:
                num_requests = max(1, round(args.requests * case.share))
                num_warmup = max(1, round(WARMUP_REQUESTS * case.share))
                rounds[case].append(await measure_case(client, sidecar, engine.url, case, num_requests, num_warmup))
                print(f"round {index + 1}/{args.repeats} {case.name} c={case.concurrency}: "
                      f"{rounds[case][-1].cpu_ms:.3f} ms CPU/request", file=sys.stderr)
        releases: dict[float, list[float]] = {}
        for gap_ms in (0.0, args.release_gap_ms) if args.release_runs else ():
            releases[gap_ms] = [await release_once(client, sidecar, engine.url, args.release_streams, gap_ms)
                                for _ in range(args.release_runs)]
            print(f"release runs, gap {gap_ms:g} ms: {releases[gap_ms]}", file=sys.stderr)
        return {case: median_figures(r) for case, r in rounds.items()}, releases
    finally:
        await client.aclose()


def print_tables(args: argparse.Namespace, cpu: dict[Case, CaseFigures], releases: dict[float, list[float]]) -> None:
    print(f"Sidecar CPU per proxied POST /generate: median of {args.repeats} rounds of {args.requests} requests "
          f"({args.requests // 10} for paced streams; target <= {CPU_TARGET_MS} ms non-stream)")
    header = (f"| {'case':<32} | {'conc.':>5} | {'sidecar CPU/req':>15} | {'of which sys':>12} "
              f"| {'idle CPU/req':>12} | {'via p50':>8} | {'direct p50':>10} | {'via p99':>9} "
              f"| {'direct p99':>10} |")
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for case, f in cpu.items():
        print(f"| {case.name:<32} | {case.concurrency:>5} | {f.cpu_ms:>12.3f} ms | {f.sys_ms:>9.3f} ms "
              f"| {f.idle_cpu_ms:>9.3f} ms | {f.sidecar_p50_ms:>5.2f} ms | {f.direct_p50_ms:>7.2f} ms "
              f"| {f.sidecar_p99_ms:>6.2f} ms | {f.direct_p99_ms:>7.2f} ms |")
    print()
    if releases:
        print_release_table(args, releases)
    print(f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}")


def print_release_table(args: argparse.Namespace, releases: dict[float, list[float]]) -> None:
    print(f"Release start latency, last stream's final byte -> engine receives the release "
          f"({args.release_streams} streams, mode wait, {args.release_runs} runs each; target <= "
          f"{RELEASE_TARGET_MS:g} ms)")
    header = f"| {'streams end':<26} | {'p50':>8} | {'p99':>8} | {'max':>8} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for gap_ms, values in releases.items():
        name = "in one turn of the loop" if not gap_ms else f"{gap_ms:g} ms apart"
        print(f"| {name:<26} | {percentile(values, 50):>5.2f} ms | {percentile(values, 99):>5.2f} ms "
              f"| {max(values):>5.2f} ms |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="measured requests per case and round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="requests in flight at once")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every case; figures are medians")
    parser.add_argument("--cases", nargs="+", choices=("non-stream", "stream", "paced"),
                        default=["non-stream", "stream", "paced"], help="which request kinds to measure")
    parser.add_argument("--release-runs", type=int, default=100, help="release runs per ending pattern (0: none)")
    parser.add_argument("--release-streams", type=int, default=8, help="streams in flight when a release comes")
    parser.add_argument("--release-gap-ms", type=float, default=2.0, help="gap between stream ends, second pattern")
    args = parser.parse_args()
    engine = start_server("bench.fake_engine", ["--stream-chunks", str(NUM_STREAM_CHUNKS)], "fake_engine")
    try:
        sidecar = start_server("node_sidecar", ["--engine-url", engine.url, "--log-level", "warning",
                                                "--engine-poll-interval", "60"], "sidecar")
        try:
            import uvloop

            cpu, releases = uvloop.run(run(args, sidecar, engine))
        finally:
            sidecar.stop()
    finally:
        engine.stop()
    print_tables(args, cpu, releases)


if __name__ == "__main__":
    main()
