"""The soak (issue 8): a whole cluster under generation load through many release/resume cycles.

One LB and two nodes (``builtin:tiny`` engines with ``--weights-backup disk``,
each behind its sidecar) run on loopback. ``num_clients`` threads send
generation requests through the LB without pause (half of them streaming)
while the main thread drives ``num_cycles`` release/resume cycles through the
LB, alternating the drain mode (``wait``, ``abort``) and the way the weights
come back:

- backup: release with ``stage_to_cpu: true``, resume every tag at once;
- reload: release with ``stage_to_cpu: false``, resume ``weights``, reload them
  with ``update_weights_from_disk`` from a checkpoint of the initial weights,
  resume the other tags.

Every request is classified (:func:`classify`): completed, aborted (finish
reason ``abort``), refused (503 with ``Retry-After``), or lost (anything else:
a connection error, another 5xx, a stream without ``[DONE]``, an error event,
an answer that is not the shape the API promises). After every cycle a fixed
probe set is generated greedily on each node and compared with the outputs
before the first cycle. RSS and open file descriptors of every process are
sampled after every cycle. :meth:`SoakReport.problems` lists every broken
promise; ``bench/soak.py`` prints the table, ``tests/e2e/test_soak.py`` runs a
short soak.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from handoff.client import HandoffClient
from handoff.protocol.sse import EventSplitter, event_data
from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.cluster.process import wait_until

ALL_TAGS = ["weights", "kv_cache", "cuda_graph", "workspace"]
NON_WEIGHT_TAGS = ["kv_cache", "cuda_graph", "workspace"]
PROBE_PROMPTS = ["The quick brown fox", "handoff probe number two", "1 2 3 4 5", "a"]
PROBE_TOKENS = 12
FINISH_REASONS = frozenset({"length", "stop", "abort"})
REFUSED_BACKOFF_S = 0.05      # a refused client's pause before its next request (client pacing)
RSS_TOLERANCE = 0.05          # RSS after the last cycle within 5% of after the first
IDLE_RSS_TOLERANCE = 0.02     # engine RSS over the cycles without load (see SoakReport.idle_engine_rss)
IDLE_WARMUP_CYCLES = 2        # cycles without load run before their first RSS sample (one of each kind)
MAX_CLOSE_WAIT = 2            # CLOSE_WAIT sockets tolerated at a sample (a peer's close not yet processed)
FILE_FD_SLACK = 2             # non-socket fds may differ by this much (e.g. a log rotation, a lazily opened file)
MAX_LOST_EXAMPLES = 10


# -- one request ------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """How one generation request ended, and why when it was lost."""

    outcome: str                 # "completed" | "aborted" | "refused" | "lost"
    detail: str = ""
    streamed: bool = False


def _check_meta(meta: Any) -> str | None:
    if not isinstance(meta, dict):
        return "meta_info is not an object"
    reason = meta.get("finish_reason")
    if reason is not None and not (isinstance(reason, dict) and reason.get("type") in FINISH_REASONS):
        return f"unknown finish_reason {reason!r}"
    if not isinstance(meta.get("completion_tokens"), int) or not isinstance(meta.get("weight_version"), str):
        return "meta_info lacks completion_tokens or weight_version"
    return None


def _check_item(item: Any) -> str | None:
    """None when ``item`` is a well-formed ``/generate`` answer (or stream event), else what is wrong."""
    if not isinstance(item, dict):
        return f"answer is {type(item).__name__}, not an object"
    if "error" in item:
        return f"error event: {json.dumps(item)[:200]}"
    if not isinstance(item.get("text"), str):
        return "text is not a string"
    ids = item.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return "output_ids is not a list of ints"
    return _check_meta(item.get("meta_info"))


def _finished(finish_reason: Any, num_tokens: int, max_new_tokens: int) -> RequestRecord:
    reason = finish_reason.get("type") if isinstance(finish_reason, dict) else None
    if reason == "length" and num_tokens == max_new_tokens:
        return RequestRecord("completed")
    if reason == "abort" and num_tokens < max_new_tokens:
        return RequestRecord("aborted")
    return RequestRecord("lost", f"finish_reason {reason!r} after {num_tokens}/{max_new_tokens} tokens")


def classify_answer(status: int, headers: httpx.Headers, body: bytes, max_new_tokens: int) -> RequestRecord:
    """A non-stream answer (or a refused stream): completed, aborted, refused or lost."""
    if status == 503:
        try:
            error_type = json.loads(body)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            return RequestRecord("lost", f"503 without the error envelope: {body[:200]!r}")
        retry_after = headers.get("retry-after", "")
        if retry_after.isdigit() and int(retry_after) >= 1:
            return RequestRecord("refused", error_type)
        return RequestRecord("lost", f"503 {error_type} without a valid Retry-After ({retry_after!r})")
    if status != 200:
        return RequestRecord("lost", f"status {status}: {body[:200]!r}")
    try:
        answer = json.loads(body)
    except ValueError:
        return RequestRecord("lost", f"200 with a body that is not JSON: {body[:200]!r}")
    problem = _check_item(answer)
    if problem is not None:
        return RequestRecord("lost", problem)
    meta = answer["meta_info"]
    if meta["completion_tokens"] != len(answer["output_ids"]):
        return RequestRecord("lost", "completion_tokens differs from len(output_ids)")
    return _finished(meta["finish_reason"], len(answer["output_ids"]), max_new_tokens)


def classify_stream(events: list[str], saw_done: bool, trailing: str, max_new_tokens: int) -> RequestRecord:
    """A 200 ``text/event-stream`` answer: its ``data:`` payloads before ``[DONE]``, whether ``[DONE]`` ended
    it (``False`` too when data followed it), and any bytes after the last complete event."""
    if trailing.strip():
        return RequestRecord("lost", f"stream ended inside an event or went on after [DONE]: {trailing[:200]!r}",
                             streamed=True)
    if not saw_done:
        last = events[-1][:200] if events else "no event"
        return RequestRecord("lost", f"stream without [DONE] (last: {last})", streamed=True)
    ids: list[int] = []
    reason = None
    for data in events:  # each event carries the whole answer so far (SGLang's default stream)
        try:
            event = json.loads(data)
        except ValueError:
            return RequestRecord("lost", f"event is not JSON: {data[:200]!r}", streamed=True)
        problem = _check_item(event)
        if problem is not None:
            return RequestRecord("lost", problem, streamed=True)
        if event["output_ids"][:len(ids)] != ids:
            return RequestRecord("lost", "an event does not extend the tokens streamed before it", streamed=True)
        ids = event["output_ids"]
        if event["meta_info"]["completion_tokens"] != len(ids):
            return RequestRecord("lost", "completion_tokens differs from the tokens streamed", streamed=True)
        reason = event["meta_info"]["finish_reason"] or reason
    record = _finished(reason, len(ids), max_new_tokens)
    record.streamed = True
    return record


# -- the load ---------------------------------------------------------------------------------------------


class Tally:
    """Outcome counts shared by the load clients (read by the driver while they run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def count(self, outcome: str | None = None) -> int:
        with self._lock:
            return sum(self._counts.values()) if outcome is None else self._counts[outcome]


class LoadClient(threading.Thread):
    """Sends generation requests to ``url`` over one keep-alive connection until stopped."""

    def __init__(self, url: str, index: int, *, stream: bool, max_new_tokens: int, stop: threading.Event,
                 tally: Tally, timeout_s: float = 60.0) -> None:
        super().__init__(name=f"load-{index}", daemon=True)
        self.tally = tally
        self.url = url
        self.index = index
        self.stream = stream
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.timeout_s = timeout_s
        self.records: list[RequestRecord] = []

    def _body(self, number: int) -> dict[str, Any]:
        return {"text": f"client {self.index} request {number}", "stream": self.stream,
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0.8,
                                    "ignore_eos": True}}

    def _one(self, http: httpx.Client, number: int) -> RequestRecord:
        try:
            if not self.stream:
                answer = http.post("/generate", json=self._body(number))
                return classify_answer(answer.status_code, answer.headers, answer.content, self.max_new_tokens)
            with http.stream("POST", "/generate", json=self._body(number)) as answer:
                if answer.status_code != 200 or not answer.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    return classify_answer(answer.status_code, answer.headers, answer.read(), self.max_new_tokens)
                events, saw_done, trailing = _read_sse(answer)
                return classify_stream(events, saw_done, trailing, self.max_new_tokens)
        except httpx.HTTPError as exc:
            return RequestRecord("lost", f"{type(exc).__name__}: {exc}", streamed=self.stream)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            number = 0
            while not self.stop.is_set():
                number += 1
                record = self._one(http, number)
                self.records.append(record)
                self.tally.add(record.outcome)
                if record.outcome == "refused":
                    self.stop.wait(REFUSED_BACKOFF_S)


def _read_sse(response: httpx.Response) -> tuple[list[str], bool, str]:
    """The ``data:`` payloads before ``[DONE]``, whether ``[DONE]`` came, and any unterminated rest (framing:
    :class:`handoff.protocol.sse.EventSplitter`, the product's own)."""
    events: list[str] = []
    saw_done = False
    splitter = EventSplitter()
    for chunk in response.iter_bytes():
        for event in splitter.feed(chunk):
            raw = event_data(event)
            if raw is None:
                continue
            data = raw.decode().strip()
            if saw_done:
                return events, False, f"data after [DONE]: {data}"
            if data == "[DONE]":
                saw_done = True
            else:
                events.append(data)
    return events, saw_done, splitter.finish().decode(errors="replace")


# -- process figures --------------------------------------------------------------------------------------


@dataclass
class ProcessSample:
    rss_bytes: int
    num_fds: int
    num_socket_fds: int
    num_close_wait: int  # TCP sockets the peer closed and this process did not: what a leaked connection looks like

    @property
    def num_file_fds(self) -> int:
        return self.num_fds - self.num_socket_fds


def sample_process(pid: int) -> ProcessSample:
    """RSS and open file descriptors of ``pid`` (sockets counted apart, from ``/proc`` where it exists)."""
    proc = psutil.Process(pid)
    rss = proc.memory_info().rss
    num_fds = proc.num_fds()
    fd_dir = Path(f"/proc/{pid}/fd")
    num_sockets = 0
    if fd_dir.is_dir():
        for name in os.listdir(fd_dir):
            try:
                if os.readlink(fd_dir / name).startswith("socket:"):
                    num_sockets += 1
            except OSError:
                continue  # closed between the listing and the read
    num_close_wait = sum(1 for conn in proc.net_connections(kind="tcp") if conn.status == psutil.CONN_CLOSE_WAIT)
    return ProcessSample(rss, num_fds, num_sockets, num_close_wait)


# -- the report -------------------------------------------------------------------------------------------


@dataclass
class SoakReport:
    num_cycles: int
    num_clients: int
    max_new_tokens: int
    duration_s: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    refusal_types: Counter[str] = field(default_factory=Counter)
    lost_examples: list[str] = field(default_factory=list)
    num_streamed: int = 0
    probe_mismatches: list[str] = field(default_factory=list)
    control_errors: list[str] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    resume_s: list[float] = field(default_factory=list)
    reload_s: list[float] = field(default_factory=list)
    drained_requests: int = 0
    aborted_by_release: int = 0
    samples: dict[str, list[ProcessSample]] = field(default_factory=dict)
    # engine RSS before and after ``idle_cycles`` cycles run without load: cycle-made growth, alone
    idle_cycles: int = 0
    idle_engine_rss: dict[str, tuple[int, int]] = field(default_factory=dict)
    dead_processes: list[str] = field(default_factory=list)
    num_clients_stuck: int = 0

    @property
    def num_requests(self) -> int:
        return sum(self.counts.values())

    def add(self, record: RequestRecord) -> None:
        self.counts[record.outcome] += 1
        self.num_streamed += record.streamed
        if record.outcome == "refused":
            self.refusal_types[record.detail] += 1
        elif record.outcome == "lost" and len(self.lost_examples) < MAX_LOST_EXAMPLES:
            self.lost_examples.append(record.detail)

    def rss_problems(self, names: list[str] | None = None) -> list[str]:
        """Processes (all, or ``names``) whose RSS after the last cycle is not within 5% of after the first."""
        found = []
        for name, samples in self.samples.items():
            first, last = samples[0], samples[-1]
            if (names is None or name in names) and abs(last.rss_bytes - first.rss_bytes) > (
                    RSS_TOLERANCE * first.rss_bytes):
                found.append(f"{name}: RSS {first.rss_bytes >> 20} MiB after the first cycle, "
                             f"{last.rss_bytes >> 20} MiB after the last (more than {RSS_TOLERANCE:.0%} apart)")
        return found

    def problems(self) -> list[str]:
        """Every promise the run broke (empty: the soak passed)."""
        found: list[str] = []
        if self.counts["lost"]:
            found.append(f"{self.counts['lost']} request(s) lost, e.g. {self.lost_examples[:3]}")
        if self.counts["completed"] == 0 or self.counts["refused"] == 0:
            found.append(f"the load did not exercise the cycles: {dict(self.counts)}")
        if self.num_cycles >= 2 and self.counts["aborted"] == 0:
            found.append("no request was aborted by the abort-mode releases")
        found += [f"probe outputs changed: {m}" for m in self.probe_mismatches[:5]]
        found += [f"control call failed: {e}" for e in self.control_errors[:5]]
        found += [f"process died: {name}" for name in self.dead_processes]
        if self.num_clients_stuck:
            found.append(f"{self.num_clients_stuck} load client(s) did not finish their last request")
        found += self.rss_problems()
        for name, (before, after) in self.idle_engine_rss.items():
            if abs(after - before) > IDLE_RSS_TOLERANCE * before:
                found.append(f"{name}: RSS {before >> 20} MiB before {self.idle_cycles} cycles without load, "
                             f"{after >> 20} MiB after (more than {IDLE_RSS_TOLERANCE:.0%} apart)")
        for name, samples in self.samples.items():
            first, last = samples[0], samples[-1]
            if last.num_close_wait > MAX_CLOSE_WAIT:
                found.append(f"{name}: {last.num_close_wait} sockets in CLOSE_WAIT after the last cycle")
            if last.num_file_fds > first.num_file_fds + FILE_FD_SLACK:
                found.append(f"{name}: non-socket fds grew from {first.num_file_fds} to {last.num_file_fds}")
            # sockets: at most one connection per client and hop may be open or pooled on top of the first count
            if last.num_socket_fds > first.num_socket_fds + 2 * self.num_clients:
                found.append(f"{name}: sockets grew from {first.num_socket_fds} to {last.num_socket_fds}")
        return found

    def table(self) -> str:
        """The figures as Markdown tables."""
        counts = self.counts
        lines = [
            f"{self.num_cycles} cycles, {self.num_clients} clients ({self.num_clients // 2} streaming), "
            f"{self.max_new_tokens} new tokens per request, {self.duration_s:.0f} s",
            "",
            "| requests | completed | aborted | refused (503 + Retry-After) | lost | streamed |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {self.num_requests} | {counts['completed']} | {counts['aborted']} | {counts['refused']} | "
            f"{counts['lost']} | {self.num_streamed} |",
            "",
            "refusals by type: " + ", ".join(f"`{k}` {v}" for k, v in sorted(self.refusal_types.items())),
            f"drained by `wait` releases: {self.drained_requests}; aborted by `abort` releases: "
            f"{self.aborted_by_release}; probe mismatches: {len(self.probe_mismatches)}; "
            f"failed control calls: {len(self.control_errors)}",
            "",
            "| control call (through the LB) | calls | p50 | max |",
            "|---|---:|---:|---:|",
        ]
        for name, values in (("release", self.release_s), ("resume", self.resume_s),
                             ("update_weights_from_disk", self.reload_s)):
            if values:
                lines.append(f"| {name} | {len(values)} | {statistics.median(values) * 1000:.0f} ms | "
                             f"{max(values) * 1000:.0f} ms |")
        lines += ["", "| process | RSS after cycle 1 | RSS after last | change | fds after cycle 1 | "
                      "fds after last | fds min..max over cycles |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, samples in self.samples.items():
            first, last = samples[0], samples[-1]
            change = (last.rss_bytes - first.rss_bytes) / first.rss_bytes
            fds = [s.num_fds for s in samples]
            lines.append(f"| {name} | {first.rss_bytes / 2**20:.1f} MiB | {last.rss_bytes / 2**20:.1f} MiB | "
                         f"{change:+.2%} | {first.num_fds} ({first.num_socket_fds} sockets) | "
                         f"{last.num_fds} ({last.num_socket_fds} sockets) | {min(fds)}..{max(fds)} |")
        if self.idle_engine_rss:
            lines += ["", f"Engine RSS over {self.idle_cycles} more cycles with no load (what the cycles alone do): "
                      + "; ".join(f"{name} {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
                                  f"({(after - before) / before:+.2%})"
                                  for name, (before, after) in self.idle_engine_rss.items())]
        return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakConfig:
    num_cycles: int = 100
    num_clients: int = 16
    max_new_tokens: int = 48
    idle_cycles: int = 10          # cycles after the load stopped, for the engines' cycle-only RSS
    control_timeout_s: float = 120.0
    progress_timeout_s: float = 60.0


def save_initial_checkpoint(path: Path) -> Path:
    """The engines' initial weights (``builtin:tiny``, seed 0) as a Hugging Face checkpoint."""
    from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint

    arch = builtin_arch("builtin:tiny")
    save_checkpoint(path, arch, builtin_weights(arch, seed=0))
    return path


class Soak:
    """Drives one soak on a started cluster; :meth:`run` returns the report."""

    def __init__(self, cluster: LocalCluster, checkpoint: Path, config: SoakConfig,
                 say: Callable[[str], None] = lambda _: None) -> None:
        self.cluster = cluster
        self.checkpoint = checkpoint
        self.config = config
        self.say = say
        self.report = SoakReport(config.num_cycles, config.num_clients, config.max_new_tokens)
        self.stop = threading.Event()
        self.tally = Tally()
        self.clients = [LoadClient(cluster.url, i, stream=i % 2 == 0, max_new_tokens=config.max_new_tokens,
                                   stop=self.stop, tally=self.tally) for i in range(config.num_clients)]
        self.control = HandoffClient(cluster.url, timeout=config.control_timeout_s)
        self.probe_http = httpx.Client(timeout=60)

    def _num_records(self, outcome: str | None = None) -> int:
        return self.tally.count(outcome)

    def probe(self) -> dict[str, list[list[int]]]:
        """Greedy outputs of the probe prompts on every node (asked directly, one batch per node)."""
        outputs = {}
        body = {"text": PROBE_PROMPTS, "sampling_params": {"max_new_tokens": PROBE_TOKENS, "temperature": 0,
                                                            "ignore_eos": True}}
        for node in self.cluster.nodes:
            answer = self.probe_http.post(node.url + "/generate", json=body)
            answer.raise_for_status()
            outputs[node.name] = [item["output_ids"] for item in answer.json()]
        return outputs

    def _sample_processes(self) -> None:
        for proc in self.cluster.processes():
            self.report.samples.setdefault(proc.name, []).append(sample_process(proc.pid))

    def _timed(self, what: list[float], call: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = call()
        what.append(time.perf_counter() - started)
        return result

    def _expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.report.control_errors.append(message)

    def idle_cycles(self, baseline: dict[str, list[list[int]]]) -> None:
        """Cycles with no load (alternating backup and reload): the engines' RSS before and after.

        Under load an engine's RSS also moves with what generation allocates (an earlier engine's CPU kernels
        grew it by a third in a few minutes, with no cycle at all; docs/reliability.md); with no load it moves
        only if a cycle leaks, so this isolates what the cycles themselves do. The first cycle of each kind
        runs before the first sample: on a busy machine the first reload without load grew an engine by about
        3 MiB that later cycles never added to.
        """
        engines = [node.engine for node in self.cluster.nodes]
        for index in range(IDLE_WARMUP_CYCLES):
            self._idle_cycle(index)
        before = {e.name: sample_process(e.pid).rss_bytes for e in engines}
        for index in range(IDLE_WARMUP_CYCLES, IDLE_WARMUP_CYCLES + self.config.idle_cycles):
            self._idle_cycle(index)
        if self.probe() != baseline:
            self.report.probe_mismatches.append("after the cycles without load")
        self.report.idle_cycles = self.config.idle_cycles
        self.report.idle_engine_rss = {e.name: (before[e.name], sample_process(e.pid).rss_bytes) for e in engines}

    def _idle_cycle(self, index: int) -> None:
        """One cycle with no load: a release with a CPU backup and a resume (even ``index``), or a release, a
        reload from disk and a resume (odd)."""
        if index % 2 == 0:
            self.control.release(stage_to_cpu=True)
            self.control.resume()
        else:
            self.control.release(stage_to_cpu=False)
            self.control.resume(tags=["weights"])
            self.control.update_weights_from_disk(str(self.checkpoint), weight_version=f"idle-{index}")
            self.control.resume(tags=NON_WEIGHT_TAGS)

    def cycle(self, index: int, baseline: dict[str, list[list[int]]]) -> None:
        config, report, control = self.config, self.report, self.control
        mode = "wait" if index % 2 == 0 else "abort"
        is_backup = (index // 2) % 2 == 0
        # the load is running: requests are in flight when the release starts
        done_before = self._num_records("completed")
        wait_until(lambda: self._num_records("completed") >= done_before + max(2, config.num_clients // 4),
                   timeout=config.progress_timeout_s, what=f"cycle {index}: load progress")
        released = self._timed(report.release_s, lambda: control.release(
            mode=mode, stage_to_cpu=is_backup, drain_timeout=config.control_timeout_s / 2))
        for node, body in released.bodies().items():
            self._expect(sorted(body["released"]) == sorted(ALL_TAGS), f"cycle {index}: {node} released {body}")
            self._expect(mode == "abort" or body["aborted_requests"] == 0,
                         f"cycle {index}: a wait release aborted {body['aborted_requests']}")
            report.drained_requests += body["drained_requests"]
            report.aborted_by_release += body["aborted_requests"]
        # while released, the LB refuses: wait for a refusal to be seen by the load
        refused_before = self._num_records("refused")
        wait_until(lambda: self._num_records("refused") > refused_before, timeout=config.progress_timeout_s,
                   what=f"cycle {index}: a refusal while released")
        if is_backup:
            resumed = self._timed(report.resume_s, lambda: control.resume())
            for node, body in resumed.bodies().items():
                self._expect(body["weights_valid"] is True, f"cycle {index}: {node} resumed invalid: {body}")
        else:
            weights = self._timed(report.resume_s, lambda: control.resume(tags=["weights"]))
            for node, body in weights.bodies().items():
                self._expect(body["weights_valid"] is False, f"cycle {index}: {node} weights valid without "
                                                             f"backup or reload: {body}")
            self._timed(report.reload_s, lambda: control.update_weights_from_disk(
                str(self.checkpoint), weight_version=f"soak-{index}"))
            self._timed(report.resume_s, lambda: control.resume(tags=NON_WEIGHT_TAGS))
        outputs = self.probe()
        if outputs != baseline:
            kind = "backup" if is_backup else "reload"
            report.probe_mismatches.append(f"cycle {index} ({mode}, {kind}): {outputs} != {baseline}")
        self._sample_processes()

    def run(self) -> SoakReport:
        config, report = self.config, self.report
        started = time.monotonic()
        baseline = self.probe()
        for client in self.clients:
            client.start()
        try:
            for index in range(config.num_cycles):
                self.cycle(index, baseline)
                if (index + 1) % 10 == 0 or index + 1 == config.num_cycles:
                    self.say(f"cycle {index + 1}/{config.num_cycles}: {self._num_records()} requests, "
                             f"{self._num_records('lost')} lost")
        finally:
            self.stop.set()
            for client in self.clients:
                client.join(config.progress_timeout_s)
            report.num_clients_stuck = sum(c.is_alive() for c in self.clients)
        try:
            if config.idle_cycles:
                self.idle_cycles(baseline)
        finally:
            self.control.close()
            self.probe_http.close()
        for client in self.clients:
            for record in client.records:
                report.add(record)
        report.dead_processes = [p.name for p in self.cluster.dead_processes()]
        report.duration_s = time.monotonic() - started
        return report


def soak_cluster_spec(**overrides: Any) -> ClusterSpec:
    """The soak's cluster: two mixed nodes on ``builtin:tiny``, weights backed up to disk."""
    return ClusterSpec(**{"num_mixed": 2, "weights_backup": "disk", **overrides})


def run_soak(config: SoakConfig, work_dir: Path, say: Callable[[str], None] = lambda _: None) -> SoakReport:
    """Start the cluster in ``work_dir``, soak it, stop it; the report says what happened."""
    checkpoint = save_initial_checkpoint(work_dir / "checkpoint-seed0")
    with LocalCluster(soak_cluster_spec(), work_dir / "logs") as cluster:
        say(f"cluster up at {cluster.url}: " + ", ".join(f"{p.name} pid {p.pid}" for p in cluster.processes()))
        return Soak(cluster, checkpoint, config, say).run()
