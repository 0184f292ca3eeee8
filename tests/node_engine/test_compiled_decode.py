"""Decode through torch.compile (``--enable-torch-compile``) on real engine processes.

The compiled engine must answer what the eager one answers: ragged batches (one
graph with a mask), a lone request (padded to two rows), after a release and
resume of every tag, and after a reload of other weights, with no compile
after start.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from node_engine.config import ConfigError, EngineConfig
from node_engine.model import layers
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.support.procs import ServerProcess

# Different lengths in one batch, and past the first token of the context.
PROMPTS = ["a", "The second prompt is longer than the first", "third: mid-size prompt"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}


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
    compiled = ServerProcess("node_engine", args + ["--enable-torch-compile"], log_dir=proc_log_dir,
                             name="compiled_engine").start(timeout=300)
    eager = ServerProcess("node_engine", args, log_dir=proc_log_dir, name="eager_engine").start(timeout=120)
    with httpx.Client(base_url=compiled.url, timeout=60) as c, httpx.Client(base_url=eager.url, timeout=60) as e:
        yield c, e
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
def test_compile_failure_is_a_clear_start_error() -> None:
    import torch._inductor.config as inductor_config

    from node_engine.memory.saver import DisabledSaver
    from node_engine.runner import ModelRunner

    config = EngineConfig(model_path="builtin:tiny", enable_torch_compile=True)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",), "force_disable_caches": True}):
        with pytest.raises(ConfigError, match="--enable-torch-compile: .*C\\+\\+ compiler"):
            ModelRunner(config, DisabledSaver(), builtin_arch("builtin:tiny"))


def test_server_info_says_decode_is_compiled(engines) -> None:
    compiled, eager = engines
    assert compiled.get("/get_server_info").json()["torch_compile"] is True
    assert eager.get("/get_server_info").json()["torch_compile"] is False


def test_compiled_decode_answers_as_eager(engines) -> None:
    compiled, eager = engines
    compiles = compile_count(compiled)
    assert compiles == 1
    assert greedy(compiled, PROMPTS) == greedy(eager, PROMPTS)
    assert greedy(compiled, PROMPTS[1]) == greedy(eager, PROMPTS[1])  # one sequence: the padded path
    assert compile_count(compiled) == compiles


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


def test_onednn_projection_compiles_as_one_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN projection, packed or plain, runs under torch.compile through handoff::onednn_project."""
    if layers._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    from node_engine.model.packing import WeightPacking, can_pack

    monkeypatch.setattr(layers, "ONEDNN_MIN_WEIGHT_NUMEL", 1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen)
    projection = layers.Projection(weight, bias)
    assert projection.is_onednn
    x = torch.randn(5, 32, generator=gen)
    expected = x @ weight.T + bias
    compiled = torch.compile(lambda t: projection(t) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), expected * 2, rtol=1e-5, atol=1e-5)
    if can_pack():
        WeightPacking([projection]).pack()
        assert projection.packed is not None and weight.untyped_storage().nbytes() == 0
        torch.testing.assert_close(compiled(x), expected * 2, rtol=1e-5, atol=1e-5)
