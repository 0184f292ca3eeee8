"""Decode through torch.compile (``--enable-torch-compile``) on real engine processes.

The compiled engine must answer what the eager one answers: ragged batches (one
graph with a mask), a lone request (padded to two rows), after a release and
resume of every tag, after a reload of other weights, and with packed oneDNN
weights, with no compile after start. The in-process runners reuse the engine
processes' kernels from Inductor's disk cache.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from node_engine.config import ConfigError, EngineConfig
from node_engine.memory.saver import DisabledSaver
from node_engine.model import projection as projections
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from node_engine.runner import ModelRunner
from tests.support.procs import ServerProcess

# Inductor's CPU backend compiles C++ (the flag needs a compiler, docs/operations.md): skipped without one.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                               reason="torch.compile on CPU needs a C++ compiler")

# Different lengths in one batch, and past the first token of the context.
PROMPTS = ["a", "The second prompt is longer than the first", "third: mid-size prompt"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}
ONE_LAYER = '{"num_layers": 1}'  # the in-process compiles: what they prove needs no more than one layer


def greedy(client: httpx.Client, prompts: list[str] | str) -> list[list[int]]:
    r = client.post("/generate", json={"text": prompts, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    return [item["output_ids"] for item in (body if isinstance(body, list) else [body])]


def compile_count(client: httpx.Client) -> float:
    """Decode graphs compiled so far, read from the engine's metrics."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("handoff_engine_decode_graphs_compiled "):
            return float(line.split()[-1])
    raise AssertionError("handoff_engine_decode_graphs_compiled is not exported")


@pytest.fixture(scope="module")
def engines(proc_log_dir: Path):
    args = ["--model-path", "builtin:tiny", "--enable-memory-saver", "--weights-backup", "cpu"]
    # launched together: the eager one starts while the other compiles
    compiled = ServerProcess("node_engine", args + ["--enable-torch-compile"], log_dir=proc_log_dir,
                             name="compiled_engine").launch()
    eager = ServerProcess("node_engine", args, log_dir=proc_log_dir, name="eager_engine").launch()
    try:
        compiled.wait_ready(timeout=300)
        eager.wait_ready(timeout=120)
        with httpx.Client(base_url=compiled.url, timeout=60) as c, httpx.Client(base_url=eager.url, timeout=60) as e:
            yield c, e
    finally:
        compiled.stop()
        eager.stop()


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("seed1")
    arch = builtin_arch("builtin:tiny")
    save_checkpoint(folder, arch, builtin_weights(arch, seed=1))
    return folder


def test_compile_is_refused_on_cuda() -> None:
    with pytest.raises(ConfigError, match="--enable-torch-compile"):
        EngineConfig(model_path="builtin:tiny", device="cuda", enable_torch_compile=True)


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_compile_failure_is_a_clear_start_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a failed compile leaves its files there
    # one layer: the compile fails the same way, after tracing a quarter of the graph
    config = EngineConfig(model_path="builtin:tiny", enable_torch_compile=True, model_override=ONE_LAYER)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",), "force_disable_caches": True}):
        with pytest.raises(ConfigError, match="--enable-torch-compile: .*C\\+\\+ compiler"):
            ModelRunner(config, DisabledSaver(), builtin_arch("builtin:tiny", config.model_override_dict()))


@needs_cxx
def test_server_info_says_decode_is_compiled(engines) -> None:
    compiled, eager = engines
    assert compiled.get("/get_server_info").json()["torch_compile"] is True
    assert eager.get("/get_server_info").json()["torch_compile"] is False


@needs_cxx
def test_compiled_decode_answers_as_eager(engines) -> None:
    compiled, eager = engines
    compiles = compile_count(compiled)
    assert compiles == 1
    assert greedy(compiled, PROMPTS) == greedy(eager, PROMPTS)
    assert greedy(compiled, PROMPTS[1]) == greedy(eager, PROMPTS[1])  # one sequence: the padded path
    assert compile_count(compiled) == compiles


@needs_cxx
def test_compiled_decode_after_release_and_resume(engines) -> None:
    compiled, eager = engines
    expected = greedy(eager, PROMPTS)
    r = compiled.post("/release_memory_occupation", json={"tags": None})
    assert r.status_code == 200, r.text
    assert compiled.post("/generate", json={"text": "x"}).status_code == 503
    r = compiled.post("/resume_memory_occupation", json={"tags": None})
    assert r.status_code == 200, r.text
    assert greedy(compiled, PROMPTS) == expected
    assert compile_count(compiled) == 1


@needs_cxx
def test_compiled_decode_after_reload(engines, other_checkpoint: Path) -> None:
    compiled, eager = engines
    before = greedy(compiled, PROMPTS)
    for client in (compiled, eager):
        r = client.post("/update_weights_from_disk", json={"model_path": str(other_checkpoint)})
        assert r.status_code == 200, r.text
    after = greedy(compiled, PROMPTS)
    assert after != before
    assert after == greedy(eager, PROMPTS)
    assert compile_count(compiled) == 1


def decode_inputs(num_seqs: int, max_len: int) -> tuple[torch.Tensor, ...]:
    """A ragged decode step over distinct slots (the first sequence is shorter)."""
    positions = torch.full((num_seqs,), max_len - 1)
    positions[0] = max_len // 2
    kv_indices = torch.arange(1, num_seqs * max_len + 1, dtype=torch.int32).view(num_seqs, max_len)
    slot_mapping = kv_indices.gather(1, positions[:, None].to(torch.int64)).squeeze(1).to(torch.int64)
    mask = (torch.arange(max_len)[None, :] <= positions[:, None]).view(num_seqs, 1, 1, max_len)
    return torch.arange(num_seqs) + 65, positions, slot_mapping, kv_indices, mask


@needs_cxx
@torch.inference_mode()
def test_each_runner_has_its_own_graph() -> None:
    """Compiled runners of two models in one process: each serves from its own graph, counted on its own."""
    def runner(overrides: str | None, is_compiled: bool) -> ModelRunner:
        config = EngineConfig(model_path="builtin:tiny", model_override=overrides, enable_torch_compile=is_compiled)
        return ModelRunner(config, DisabledSaver(), builtin_arch("builtin:tiny", config.model_override_dict()))

    for overrides in (None, '{"num_layers": 2}'):
        compiled, eager = runner(overrides, True), runner(overrides, False)
        for num_seqs, max_len in ((3, 9), (1, 5), (6, 2)):
            inputs = decode_inputs(num_seqs, max_len)
            torch.testing.assert_close(compiled.decode_forward(*inputs), eager.decode_forward(*inputs),
                                       rtol=1e-5, atol=1e-5)
        assert compiled.compiled_decode.num_graphs == 1


@needs_cxx
@torch.inference_mode()
def test_packed_onednn_model_compiles_and_answers_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection on oneDNN and packed: the compiled decode calls handoff::onednn_project."""
    if projections._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(projections, "ONEDNN_MIN_WEIGHT_NUMEL", 1)
    configs = [EngineConfig(model_path="builtin:tiny", model_override=ONE_LAYER, enable_torch_compile=is_compiled)
               for is_compiled in (True, False)]  # one layer: a graph of its own, compiled cold; a quarter the size
    arch = builtin_arch("builtin:tiny", configs[0].model_override_dict())
    compiled, eager = (ModelRunner(config, DisabledSaver(), arch) for config in configs)
    assert compiled.model.model.layers[0].mlp.gate_up.is_onednn
    for num_seqs, max_len in ((4, 7), (1, 3)):
        inputs = decode_inputs(num_seqs, max_len)
        torch.testing.assert_close(compiled.decode_forward(*inputs), eager.decode_forward(*inputs),
                                   rtol=1e-5, atol=1e-5)
    assert compiled.compiled_decode.num_graphs == 1


@needs_cxx
def test_onednn_projection_compiles_as_one_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN projection, packed or plain, runs under torch.compile through handoff::onednn_project."""
    if projections._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    from node_engine.model.packing import WeightPacking, can_pack

    monkeypatch.setattr(projections, "ONEDNN_MIN_WEIGHT_NUMEL", 1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen)
    projection = projections.Projection(weight, bias)
    assert projection.is_onednn
    x = torch.randn(5, 32, generator=gen)
    expected = x @ weight.T + bias
    compiled = torch.compile(lambda t: projection(t) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), expected * 2, rtol=1e-5, atol=1e-5)
    if can_pack():
        WeightPacking([projection]).pack()
        assert projection.packed is not None and weight.untyped_storage().nbytes() == 0
        torch.testing.assert_close(compiled(x), expected * 2, rtol=1e-5, atol=1e-5)
