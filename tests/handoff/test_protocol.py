"""The shared contract: one definition of every wire name, used by all three processes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from handoff.protocol import errors as E
from handoff.protocol.tags import ALL_TAGS, TAG_NAMES, Tag, UnknownTag, parse_tags
from handoff.service.errors import ServiceError

ROOT = Path(__file__).resolve().parents[2]


def test_tag_lists_follow_sglang() -> None:
    assert parse_tags(None) is None
    assert parse_tags([]) == ()
    assert parse_tags(["workspace", "weights", "weights"]) == (Tag.WEIGHTS, Tag.WORKSPACE)
    with pytest.raises(UnknownTag, match="vram"):
        parse_tags(["weights", "vram"])
    assert TAG_NAMES == tuple(t.value for t in ALL_TAGS) == ("weights", "kv_cache", "cuda_graph", "workspace")


def _catalog() -> dict[str, E.ErrorType]:
    return {value.name: value for value in vars(E).values() if isinstance(value, E.ErrorType)}


def test_each_error_type_has_one_status() -> None:
    names = [value.name for value in vars(E).values() if isinstance(value, E.ErrorType)]
    assert len(names) == len(set(names))
    for reason in E.NotServingReason:
        assert _catalog()[reason.value].status == 503


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def test_every_process_error_names_a_catalog_entry() -> None:
    import lb.errors  # noqa: F401
    import node_engine.errors  # noqa: F401
    import node_sidecar.errors  # noqa: F401

    catalog = _catalog()
    for cls in _all_subclasses(ServiceError):
        if cls.__name__ == "EngineRefused":  # passes the engine's own envelope on
            continue
        assert cls.type in catalog, f"{cls.__module__}.{cls.__name__} answers {cls.type!r}, not in the catalog"
        assert catalog[cls.type].status == cls.status, f"{cls.__name__}: {cls.status} != catalog"


def test_no_process_spells_a_tag_tuple_or_an_error_type_of_its_own() -> None:
    """The processes take tag names and error types from handoff/protocol (the demo and the client are user code
    and may spell tags as a user would)."""
    offenders = []
    for package in ("lb", "node_sidecar", "node_engine", "handoff/service"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) >= 3 and all(
                        isinstance(e, ast.Constant) and e.value in TAG_NAMES for e in node.elts):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} spells the tag list")
                if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "type"
                                                         for t in node.targets)
                        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} defines an error type")
                if (isinstance(node, ast.keyword) and node.arg in ("type", "error_type")
                        and isinstance(node.value, ast.Constant) and node.value.value in _catalog()):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.value.lineno} spells an error type")
    assert not offenders, offenders


def test_the_contract_modules_import_without_torch() -> None:
    """The LB and the sidecar load handoff/protocol; none of its modules may pull torch (or CUDA) in."""
    modules = sorted(f"handoff.protocol.{path.stem}" for path in (ROOT / "handoff" / "protocol").glob("*.py")
                     if path.stem != "__init__")
    code = ("import sys, importlib\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'safetensors'))\n"
            "print(','.join(loaded))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(modules) >= 8 and result.stdout.strip() == "", result.stdout


def test_every_sglang_shaped_body_takes_basereqs_fields_and_keeps_them_from_engines() -> None:
    """SGLang 0.5.23's request structs are all ``BaseReq``s (``rid``, ``http_worker_ipc``); a serialized one sends
    them, often null. Accepted on every body modelled on one, and never passed on to an engine."""
    from pydantic import BaseModel

    from handoff.protocol.control import CONTROL_BODIES, AbortBody, SGLangRequest
    from handoff.protocol.weights import WEIGHT_BODIES

    required = {"/update_weights_from_tensor": {"serialized_named_tensors": ["x"]},
                "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                               "world_size": 2},
                "/update_weights_from_distributed": {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},
                "/update_weight_version": {"new_version": "v"}, "/update_weights_from_disk": {"model_path": "/m"}}
    bodies: dict[str, type[BaseModel]] = {**CONTROL_BODIES, **WEIGHT_BODIES}
    for path, model in bodies.items():
        if model is AbortBody:  # its rid names the request to abort
            continue
        assert issubclass(model, SGLangRequest), path
        body = model.model_validate({**required.get(path, {}), "rid": "r-1", "http_worker_ipc": None})
        assert "rid" not in body.engine_body() and "http_worker_ipc" not in body.engine_body()


def test_group_ranks_stay_within_what_torch_distributed_takes() -> None:
    """Found by review: a rank_offset of 2^31 reached torch, whose TypeError was a 500."""
    from pydantic import ValidationError

    from handoff.protocol.weights import InitWeightsUpdateGroupBody

    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2**16}
    assert InitWeightsUpdateGroupBody.model_validate(body).world_size == 2**16
    for bad in ({"world_size": 2**31, "rank_offset": 1}, {"world_size": 2**31 + 1, "rank_offset": 2**31},
                {"world_size": 2**16 + 1, "rank_offset": 1}, {"world_size": 2**16, "rank_offset": 2**16}):
        with pytest.raises(ValidationError):
            InitWeightsUpdateGroupBody.model_validate({**body, **bad})
