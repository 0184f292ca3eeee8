"""``handoff demo``: one RL step through the LB on a local cluster, shown as it happens.

1. rollout (some streaming); 2. release everything in ``wait`` mode while
streams run; 3. "train" in the freed memory; 4. resume weights, reload a new
checkpoint, resume the rest, flush; 5. rollout again on the new weights;
6. a release/resume with the weights backup, outputs identical; 7. a node
fails a release: the LB's 502 names it, the node comes back.
With a vision-language model (``--model builtin:tiny-vl``) a step comes before
the last: image requests through the LB and the sidecars, a release/resume of
the VL nodes, the vision reservation restored, outputs identical
(:mod:`handoff.demo_images`).
Every step checks what it shows; any surprise ends the demo with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Coroutine

import psutil

from handoff.client import AsyncHandoffClient, FanoutFailed, HandoffError
from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.cluster.process import ProcessFailed
from handoff.demo_signals import ctrl_c_held_back, kill_on_later_ctrl_c

# A built-in model big enough for memory figures to mean something (~70 MB of weights, ~100 MB of KV).
DEMO_MODEL = json.dumps({"hidden_size": 512, "intermediate_size": 1408, "num_layers": 6, "num_heads": 8,
                         "num_kv_heads": 4, "head_dim": 64})
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "RL is",
           "The weather today", "Q: 2+2=? A:", "import torch", "Hello, my name is"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
MiB = 2**20
DEFAULT_MODEL, VL_MODEL = "builtin:tiny", "builtin:tiny-vl"


class DemoFailed(RuntimeError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise DemoFailed(message)


def is_vision_model(model: str) -> bool:
    return model == VL_MODEL


@dataclass
class StepReport:
    name: str
    outcome: str
    seconds: float


class Demo:
    def __init__(self, cluster: LocalCluster, client: AsyncHandoffClient, checkpoint: Path,
                 say: Callable[[str], None], model: str = DEFAULT_MODEL) -> None:
        """``checkpoint``: the "trained" weights step 4 loads (:func:`write_step1_checkpoint`)."""
        self.cluster = cluster
        self.client = client
        self.checkpoint = checkpoint
        self.say = say
        self.model = model
        self.reports: list[StepReport] = []

    async def step(self, name: str, run: Callable[[], Any]) -> None:
        self.say(f"\n== {name}")
        started = time.perf_counter()
        outcome = await run()
        self.reports.append(StepReport(name, outcome, time.perf_counter() - started))
        self.say(f"   -> {outcome}")

    # -- helpers ---------------------------------------------------------------
    def rss(self) -> dict[str, int]:
        return {n.name: psutil.Process(n.engine.pid).memory_info().rss for n in self.cluster.nodes}

    async def greedy_outputs(self) -> tuple[list[list[int]], set[str]]:
        answers = await self.client.generate(PROMPTS[:4], sampling_params=GREEDY)
        return [a["output_ids"] for a in answers], {a["meta_info"]["weight_version"] for a in answers}

    async def stream(self, prompt: str, max_new_tokens: int) -> dict[str, Any]:
        events = [e async for e in self.client.stream_generate(prompt, sampling_params={
            "temperature": 0.8, "max_new_tokens": max_new_tokens, "ignore_eos": True})]
        return events[-1]["meta_info"]

    @staticmethod
    @contextlib.asynccontextmanager
    async def streams(coros: list[Coroutine[Any, Any, dict[str, Any]]]) -> AsyncIterator[list[asyncio.Task]]:
        """The streams as tasks, none left running when the block ends: a step cut short (Ctrl-C, a failure)
        left them to fail once the client closed, each a "Task exception was never retrieved" traceback."""
        tasks = [asyncio.create_task(coro) for coro in coros]
        try:
            yield tasks
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_in_flight(self, minimum: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            nodes = await self.client.nodes()
            if sum(n.get("in_flight") or 0 for n in nodes) >= minimum:
                return
            await asyncio.sleep(0.02)
        raise DemoFailed(f"the streams did not start (wanted {minimum} in flight)")

    # -- the steps -------------------------------------------------------------
    async def rollout(self) -> str:
        async with self.streams([self.stream(p, 24) for p in PROMPTS[:3]]) as streams:
            answers = await self.client.generate(PROMPTS[3:], sampling_params={"temperature": 0.8,
                                                                               "max_new_tokens": 24})
            metas = await asyncio.gather(*streams)
        self.say(f"   ({self.model} has random weights: its text is noise; the demo is about what happens around it)")
        for prompt, answer in zip(PROMPTS[3:6], answers):
            self.say(f"   {prompt!r} -> {len(answer['output_ids'])} tokens {answer['text'][:24]!r}")
        self.baseline, versions = await self.greedy_outputs()
        check(all(m["finish_reason"]["type"] == "length" for m in metas), "a streamed rollout did not finish")
        return f"{len(answers)} answers + {len(metas)} streams, weight_version {sorted(versions)}"

    async def release_under_load(self) -> str:
        before = self.rss()
        async with self.streams([self.stream(p, 300) for p in PROMPTS[:4]]) as streams:
            await self.wait_in_flight(2)
            result = await self.client.release(mode="wait", stage_to_cpu=False)
            metas = await asyncio.gather(*streams)
        after = self.rss()
        check(all(m["finish_reason"]["type"] == "length" for m in metas), "a stream was cut by the release")
        self.freed = 0
        for node in result.results:
            body = node.body
            freed = sum(body["bytes_freed"].values())
            self.freed += freed
            name = next(n.name for n in self.cluster.nodes if n.url == node.node)
            tags = ", ".join(f"{t} {b / MiB:.1f}" for t, b in body["bytes_freed"].items())
            self.say(f"   {name}: drained {body['drained_requests']}, freed {freed / MiB:.1f} MiB ({tags}); "
                     f"engine RSS {before[name] / MiB:.0f} -> {after[name] / MiB:.0f} MiB")
            check(before[name] - after[name] > 0.8 * freed, f"{name}'s RSS did not drop by what it freed")
        return f"released on {result.total} nodes while 4 streams ran; all streams completed; " \
               f"{self.freed / MiB:.0f} MiB freed"

    async def train(self) -> str:
        started = time.perf_counter()
        block = bytearray(self.freed)   # the memory the nodes gave back, taken and touched
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        del block
        return f"allocated and touched {self.freed / MiB:.0f} MiB in {time.perf_counter() - started:.2f}s"

    async def reload(self) -> str:
        await self.client.resume(tags=["weights"])
        refused = await self._generation_refused()
        await self.client.update_weights_from_disk(str(self.checkpoint), weight_version="step-1")
        await self.client.resume(tags=["kv_cache", "cuda_graph", "workspace"])
        await self.client.flush_cache()
        return f"weights resumed (generation refused meanwhile: {refused}), step-1 loaded, rest resumed, flushed"

    async def _generation_refused(self) -> str:
        try:
            await self.client.generate("x", sampling_params={"max_new_tokens": 1})
        except HandoffError as exc:
            return f"{exc.status} {exc.type}"
        raise DemoFailed("a node served generation with unloaded weights")

    async def rollout_new_weights(self) -> str:
        outputs, versions = await self.greedy_outputs()
        check(versions == {"step-1"}, f"expected weight_version step-1, got {versions}")
        num_changed = sum(a != b for a, b in zip(outputs, self.baseline))
        check(num_changed > 0, "outputs did not change after the reload")
        self.step1_outputs = outputs
        return f"weight_version step-1; {num_changed}/{len(outputs)} greedy outputs changed"

    async def backup_cycle(self) -> str:
        started = time.perf_counter()
        await self.client.release(mode="wait", stage_to_cpu=True)
        result = await self.client.resume()
        check(all(r.body["weights_valid"] for r in result.results), "weights not restored from the backup")
        outputs, _ = await self.greedy_outputs()
        check(outputs == self.step1_outputs, "outputs differ after a cycle with the weights backup")
        return f"release + resume with backup in {time.perf_counter() - started:.2f}s; greedy outputs identical"

    async def partial_failure(self) -> str:
        victim = self.cluster.nodes[0]
        victim.engine.kill()
        self.say(f"   killed {victim.name}'s engine (pid {victim.engine.pid})")
        try:
            await self.client.release(mode="wait", timeout=10)
        except FanoutFailed as exc:
            self.say(f"   LB answered 502: {exc.message}; succeeded: {[s.node for s in exc.succeeded]}")
            check(exc.failed_nodes == [victim.url], f"502 should name {victim.url}, named {exc.failed_nodes}")
            check(len(exc.succeeded) == len(self.cluster.nodes) - 1, "the other nodes should have succeeded")
        else:
            raise DemoFailed("a release with a dead engine did not fail")
        await victim.engine.restart()
        view = await self._wait_node(
            victim.url, lambda n: n.get("not_serving_reason") not in (None, "engine_unavailable"), "reachable again")
        check(view.get("not_serving_reason") == "weights_stale",
              f"a restarted engine on its start checkpoint should not serve, got {view.get('not_serving_reason')}")
        self.say(f"   {victim.name}'s engine restarted on its start checkpoint: held out as weights_stale")
        await self.client.resume()  # the others were released; the restarted node is already resident
        await self.client.update_weights_from_disk(str(self.checkpoint), weight_version="step-1")
        await self._wait_node(victim.url, lambda n: n.get("serving"), "serving again")
        _, versions = await self.greedy_outputs()
        check(versions == {"step-1"}, f"nodes disagree on weights after recovery: {versions}")
        return f"502 named {victim.name}; restarted engine held out until step-1 was reloaded, all nodes on step-1"

    async def _wait_node(self, url: str, wanted: Callable[[dict[str, Any]], Any], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for view in await self.client.nodes():
                if view["url"] == url and wanted(view):
                    return view
            await asyncio.sleep(0.1)
        raise DemoFailed(f"{url} was not {what} within 30 s after its engine restarted")


def write_step1_checkpoint(workdir: Path, model: str) -> Path:
    """The checkpoint step 4 loads: the start weights after a small "training step". Written on the main thread
    before the steps run: Ctrl-C interrupts it at once, where inside a step (blocking the event loop) it held the
    stop back until the last byte was written (torch's import, the weights, the file: tens of seconds under load)."""
    with ctrl_c_held_back():
        from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint

    arch = builtin_arch(model, json.loads(DEMO_MODEL))
    weights = builtin_weights(arch, seed=0)
    for name, tensor in weights.items():
        if name.endswith("proj.weight"):
            tensor.add_(0.02 * tensor.std() * (tensor.sign()))
    path = workdir / "step-1"
    save_checkpoint(path, arch, weights)
    return path


async def _play(cluster: LocalCluster, checkpoint: Path, say: Callable[[str], None], model: str) -> list[StepReport]:
    async with AsyncHandoffClient(cluster.url, timeout=120) as client:
        demo = Demo(cluster, client, checkpoint, say, model)
        await demo.step("1. rollout", demo.rollout)
        await demo.step("2. release all tags (wait) while streams run", demo.release_under_load)
        await demo.step("3. train in the freed memory", demo.train)
        await demo.step("4. resume weights, reload step-1, resume the rest, flush", demo.reload)
        await demo.step("5. rollout on the new weights", demo.rollout_new_weights)
        await demo.step("6. release/resume with the weights backup", demo.backup_cycle)
        number = 7
        if is_vision_model(model):
            from handoff.demo_images import ImageStep

            await demo.step(f"{number}. images through the LB, release/resume of the VL nodes",
                            ImageStep(demo).run)
            number += 1
        await demo.step(f"{number}. a node fails a release, then comes back", demo.partial_failure)
        return demo.reports


def run_demo(num_nodes: int = 2, *, model: str = DEFAULT_MODEL, log_dir: Path | None = None,
             say: Callable[[str], None] = print) -> int:
    if model not in (DEFAULT_MODEL, VL_MODEL):
        raise ValueError(f"the demo runs {DEFAULT_MODEL} or {VL_MODEL}, not {model!r}")
    started = time.perf_counter()
    logs = log_dir or Path(tempfile.mkdtemp(prefix="handoff-demo-logs-"))  # kept: a failure points at them
    with tempfile.TemporaryDirectory(prefix="handoff-demo-") as tmp:
        workdir = Path(tmp)
        spec = ClusterSpec(num_mixed=num_nodes, model_path=model, model_override=DEMO_MODEL, weights_backup="disk")
        say(f"starting {num_nodes} nodes of {model} (engine + sidecar each) and the LB; logs in {logs}")
        cluster = LocalCluster(spec, logs, die_with_parent=True)  # a demo killed (SIGTERM: no handler) leaves none
        try:
            cluster.start()
            say(f"LB at {cluster.url}; nodes: {', '.join(n.url for n in cluster.nodes)}")
            checkpoint = write_step1_checkpoint(workdir, model)
            reports = asyncio.run(_play(cluster, checkpoint, say, model))
        except (DemoFailed, ProcessFailed, HandoffError, OSError) as exc:
            say(f"\nDEMO FAILED: {exc}\n(logs: {logs})")
            return 1
        except KeyboardInterrupt:
            kill_on_later_ctrl_c(cluster)
            say(f"\ninterrupted: stopping the cluster (logs: {logs})")
            return 130
        finally:
            cluster.stop()
    say("\nsummary")
    width = max(len(r.name) for r in reports)
    for r in reports:
        say(f"  {r.name:<{width}}  {r.seconds:6.2f}s  {r.outcome}")
    say(f"\nall steps passed in {time.perf_counter() - started:.1f}s")
    return 0
