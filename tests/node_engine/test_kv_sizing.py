"""The KV pool sized from measured peaks (CPU: a memory budget against the process's RSS).

Small knobs (context, chunk, batch) keep each stress to a fraction of a second.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import torch

from node_engine.config import EngineConfig
from node_engine.kv_sizing import CANARY_BYTES, MAX_RETRIES, SHRINK_FACTOR, KVSizingError
from node_engine.memory.peak import HostPeakMeter
from node_engine.memory.saver import DisabledSaver
from node_engine.model.source import load_model_source
from node_engine.runner import ModelRunner
from tests.support.procs import ServerProcess

MiB = 2**20
KNOBS = dict(context_length=512, max_batch_tokens=256, max_running_requests=8)


def _make(model: str, budget_mb: int, kv_allocate=None, **kwargs) -> ModelRunner:
    config = EngineConfig(model_path=model, memory_budget_mb=budget_mb, **KNOBS, **kwargs)
    arch, _ = load_model_source(config)
    return ModelRunner(config, DisabledSaver(), arch, kv_allocate=kv_allocate)


def _budget_mb(extra_mb: int) -> int:
    """A budget ``extra_mb`` above what this process holds now."""
    return HostPeakMeter().current_bytes() // MiB + extra_mb


class FailingAllocations:
    """The sizer's allocation function, failing the first ``num_failures`` canaries as an allocator would."""

    def __init__(self, model: str, num_failures: int) -> None:
        self.arch, _ = load_model_source(EngineConfig(model_path=model))
        self.num_failures = num_failures
        self.calls: list[tuple[str, int]] = []

    def __call__(self, kind: str, num: int) -> torch.Tensor:
        self.calls.append((kind, num))
        if kind == "pool":
            arch = self.arch
            return torch.zeros(arch.num_layers, num, 2 * arch.num_kv_heads, arch.head_dim)
        if self.num_failures > 0:
            self.num_failures -= 1
            raise torch.OutOfMemoryError("injected: cannot allocate the canary")
        return torch.zeros(num, dtype=torch.uint8)


def _sized_with(failures: int, budget_mb: int) -> tuple[ModelRunner | None, FailingAllocations, str]:
    """A runner whose first ``failures`` canaries fail (or None, and the start error)."""
    allocations = FailingAllocations("builtin:tiny", failures)
    try:
        return _make("builtin:tiny", budget_mb, kv_allocate=allocations), allocations, ""
    except KVSizingError as exc:
        return None, allocations, str(exc)


def test_the_pool_fills_the_budget_after_the_measured_peaks() -> None:
    budget_mb = _budget_mb(CANARY_BYTES // MiB + 64)
    runner = _make("builtin:tiny", budget_mb)
    report = runner.kv_sizing
    assert report is not None and report.attempts[-1].outcome == "ok"
    assert report.activation_peak_bytes > 0
    expected_bytes = report.free_bytes - report.activation_peak_bytes - CANARY_BYTES
    assert report.target_slots == expected_bytes // report.bytes_per_slot
    num_slots = runner.kv_plan.num_slots
    assert num_slots == report.num_slots and num_slots >= report.target_slots * SHRINK_FACTOR ** MAX_RETRIES
    assert runner.kv_cache.shape[1] == num_slots
    # The canary's 256 MiB are free again: what the engine holds now is within the budget with room to spare.
    assert HostPeakMeter().current_bytes() <= budget_mb * MiB - CANARY_BYTES // 2


def test_an_injected_allocation_failure_shrinks_the_pool_by_5_percent_and_retries() -> None:
    runner, allocations, _ = _sized_with(1, _budget_mb(CANARY_BYTES // MiB + 64))
    assert runner is not None
    report = runner.kv_sizing
    assert [a.outcome for a in report.attempts][0].startswith("injected")
    assert report.attempts[1].outcome == "ok"
    first, second = report.attempts[0].num_slots, report.attempts[1].num_slots
    assert first == report.target_slots
    assert abs(second - first * SHRINK_FACTOR) <= 1
    assert runner.kv_plan.num_slots == second
    assert [kind for kind, _ in allocations.calls] == ["pool", "pool", "canary", "pool", "canary"]


def test_three_retries_then_a_start_error_naming_every_knob() -> None:
    runner, allocations, message = _sized_with(1 + MAX_RETRIES, _budget_mb(CANARY_BYTES // MiB + 64))
    assert runner is None
    assert sum(kind == "canary" for kind, _ in allocations.calls) == 1 + MAX_RETRIES
    for knob in ("--memory-budget-mb", "--max-total-tokens", "--max-batch-tokens 256",
                 "--max-running-requests 8", "MiB"):
        assert knob in message
    assert message.count("injected") == 1 + MAX_RETRIES


def test_max_total_tokens_pins_the_pool_and_skips_sizing() -> None:
    runner = _make("builtin:tiny", 100, max_total_tokens=300)  # a budget far too small is not even read
    assert runner.kv_sizing is None and runner.kv_plan.num_slots == 301


_VL_ARGS = ["--model-path", "builtin:tiny-vl", "--context-length", "512", "--max-batch-tokens", "256",
            "--max-running-requests", "8", "--visual-batch-max-tokens", "4096"]
_NEEDS = re.compile(r"holds ([0-9.]+) MiB before the pool .* is ([0-9.]+) MiB and the canary ([0-9.]+) MiB")
_RESERVED = re.compile(r"of which the vision reservation ([0-9.]+) MiB")


def _failed_start(tmp_path: Path, budget_mb: int, *flags: str) -> str:
    """The start error of an engine on ``budget_mb`` (it must not start)."""
    port_file = tmp_path / f"port-{budget_mb}-{len(flags)}"
    proc = subprocess.run([sys.executable, "-m", "node_engine", *_VL_ARGS, "--memory-budget-mb", str(budget_mb),
                           *flags, "--port", "0", "--port-file", str(port_file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not port_file.exists(), proc.stderr[-2000:]
    return proc.stderr


def test_a_budget_too_small_for_the_worst_case_image_fails_to_start(tmp_path: Path) -> None:
    """A real engine process on a budget that holds everything but the measured vision reservation: the start
    error names every knob; the same budget without the reservation starts (control). The budget comes from
    this machine's own figures (what the process holds varies by tens of MiB between machines)."""
    measured = _failed_start(tmp_path, 100)  # far too small: the figures, measured (one start: each costs seconds)
    held, activations, canary = (float(x) for x in _NEEDS.search(measured).groups())
    reserved = float(_RESERVED.search(measured).group(1))
    assert reserved > 100  # measured from 16 worst-case images, not a token figure
    # the pool fits without the reservation, not with it (held without it: the measurement's leftovers, some
    # 15 MiB, stay in; each side keeps a margin of about half the reservation)
    budget = math.ceil(held - reserved + activations + canary + 2 + reserved / 2)
    control = ServerProcess("node_engine", [*_VL_ARGS, "--memory-budget-mb", str(budget), "--vision-reserve-mb", "0"],
                            log_dir=tmp_path, name="control")
    control.launch()  # loads while the start below fails: two starts of seconds each, at once
    try:
        message = _failed_start(tmp_path, budget)
        for knob in ("no KV pool fits", f"--memory-budget-mb {budget}", "--max-total-tokens",
                     "--max-batch-tokens 256", "--max-image-tokens 256", "--visual-batch-max-tokens 4096",
                     "vision reservation"):
            assert knob in message, message[-2000:]
        control.wait_ready(timeout=120)  # without the reservation the same budget starts (ProcessFailed otherwise)
    finally:
        control.stop()


class _SteadyMeter:
    """A peak meter that reads a fixed resident size (no activation peak): the budget leaves exactly what the test
    says, whatever this process holds."""

    def __init__(self, current_bytes: int) -> None:
        self.current = current_bytes

    def reset(self) -> None:
        pass

    def current_bytes(self) -> int:
        return self.current

    def peak_bytes(self) -> int:
        return self.current


def test_a_budget_that_leaves_a_pool_too_small_for_one_request_is_a_start_error(monkeypatch) -> None:
    """--max-batch-tokens 1 lowered the sizer's floor to 2 slots: a budget leaving room for 5 slots started an
    engine whose pool holds 4 tokens, under SGLang's ``max_req_input_len`` (pool less 6) every prompt is refused.
    The floor is the least pool that takes a one-token prompt (``--max-total-tokens``' own floor)."""
    from node_engine import kv_pool
    from node_engine.config import MIN_REQUEST_ROOM_TOKENS
    from node_engine.engine import Engine

    budget_mb = 1024
    config = EngineConfig(model_path="builtin:tiny", memory_budget_mb=budget_mb, context_length=512,
                          max_batch_tokens=1, max_running_requests=1)
    arch, _ = load_model_source(config)
    bytes_per_slot = 2 * arch.num_layers * arch.kv_size * 4
    meter = _SteadyMeter(budget_mb * MiB - CANARY_BYTES - 5 * bytes_per_slot)  # room for 5 slots, padding's included
    monkeypatch.setattr(kv_pool, "HostPeakMeter", lambda: meter)
    try:
        engine = Engine(config)
    except KVSizingError as exc:
        assert "--max-batch-tokens 1" in str(exc) and "--memory-budget-mb 1024" in str(exc)
        assert f"at least {MIN_REQUEST_ROOM_TOKENS + 1} needed" in str(exc), str(exc)
        return
    capacity = engine.scheduler.slots.capacity
    assert engine.gate.max_input_tokens() >= 2, \
        f"the engine started with a {capacity}-token pool that refuses every prompt"


def test_a_probe_that_runs_out_of_memory_is_a_start_error_naming_every_knob() -> None:
    """The probe's stresses (the maximum batch, every sequence as long as the context) or its pool running out of
    memory escaped the sizer: a traceback from torch's allocator at start (on CUDA, --max-running-requests 64 over
    a 128k context asks tens of GiB of keys), not the start error naming the knobs that make it fit."""
    def probe_fails(kind: str, num: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 32.00 GiB")

    try:
        _make("builtin:tiny", _budget_mb(CANARY_BYTES // MiB + 64), kv_allocate=probe_fails)
    except KVSizingError as exc:
        message = str(exc)
    else:
        raise AssertionError("the engine started although its probe ran out of memory")
    for knob in ("--memory-budget-mb", "--max-total-tokens", "--max-batch-tokens 256", "--max-running-requests 8",
                 "--context-length", "injected"):
        assert knob in message, message


def test_the_computed_step_headroom_covers_the_heaviest_decode_step() -> None:
    """With a pinned pool (no sizer), a resume keeps the computed step headroom free for the first step. It
    counted a decode step's keys as at most the pool's slots (8193 here), but a step gathers every sequence's keys
    padded to the longest: 64 requests, one of them 4096 tokens long, gather 64 x 4096. The bound was 3.8 MiB for
    a step that takes over 130 MiB: a resume passed its check and left the first long decode no memory."""
    config = EngineConfig(model_path="builtin:tiny", max_total_tokens=8192, context_length=4096,
                          max_running_requests=64, max_batch_tokens=256)
    runner = ModelRunner(config, DisabledSaver(), load_model_source(config)[0])
    assert runner.kv_sizing is None
    meter = HostPeakMeter()
    meter.reset()
    before = meter.current_bytes()
    runner.stress(runner.kv_plan.num_slots)  # the heaviest prefill and decode steps this engine can run
    measured = meter.peak_bytes() - before
    assert measured <= 1.25 * runner.step_headroom_bytes, (measured / MiB, runner.step_headroom_bytes / MiB)
    assert runner.step_headroom_bytes <= 3 * measured  # an upper bound, not one that refuses every resume


def test_a_system_that_cannot_measure_the_peak_is_a_start_error_naming_the_budget(monkeypatch, tmp_path) -> None:
    """Where ``/proc/self/clear_refs`` cannot be written (gVisor, a read-only /proc), ``--memory-budget-mb``
    started into a ``PeakUnavailable`` traceback (exit 1), not a line naming the flag and what to use instead."""
    from node_engine.memory import peak

    monkeypatch.setattr(peak, "_CLEAR_REFS", tmp_path / "no-such-folder" / "clear_refs")
    try:
        _make("builtin:tiny", _budget_mb(CANARY_BYTES // MiB + 64))
    except KVSizingError as exc:
        assert "--memory-budget-mb" in str(exc) and "--max-total-tokens" in str(exc), str(exc)
    else:
        raise AssertionError("the engine started although it cannot measure its peak")
