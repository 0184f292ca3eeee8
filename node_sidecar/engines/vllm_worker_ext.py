"""handoff's vLLM worker extension: SGLang's weight-sync calls inside a vLLM worker (``--worker-extension-cls``).

Only vLLM's worker imports this module (it needs torch; the sidecar never
imports it). vLLM mixes the class into its worker and exposes its methods
through ``POST /collective_rpc`` (dev mode); the sidecar's vLLM adapter
(:mod:`node_sidecar.engines.vllm`) maps SGLang's calls onto them. Every method
answers a JSON object ``{"ok": true, ...}`` or ``{"ok": false, "error": TYPE,
"message": ...}`` (TYPE one of handoff's error names), never raises.

- The group is joined exactly as handoff's engine joins it
  (:mod:`node_engine.weight_sync.group`: SGLang's store and key prefix, gloo on
  CPU), on a thread of its own so that vLLM keeps serving (and a destroy can
  abandon the join) while the trainer is awaited; the sidecar polls
  :meth:`handoff_weight_group` until it is joined, failed, or past its timeout.
  The group's timeout bounds each broadcast.
- An update is checked on its announced metadata first, against the tensors of
  the checkpoint vLLM serves (names, shapes; floating dtypes) and vLLM's fused
  layers: a layer vLLM fuses (``q/k/v_proj`` into ``qkv_proj``, ``gate/up_proj``
  into ``gate_up_proj``) is loaded whole or not at all, because on CPU vLLM keeps
  a linear layer only in its packed form and the rest of a half-sent layer could
  not be filled in. A refused update's broadcasts are still received and
  discarded when they fit in twice the model, so the group stays in step;
  otherwise the group is marked broken (destroy and join again).
- ``stage``: received (or decoded) and checked but not loaded, kept until
  :meth:`handoff_load_staged` (or dropped by :meth:`handoff_drop_staged`): the
  sidecar stages an update over sleeping weights, so that a refused one leaves
  them asleep, and wakes them only to load.
- Everything is received before anything loads; loading is vLLM's in-place
  reload (``reload_weights`` with the received tensors: the model's
  ``load_weights`` layer by layer, then its post-load processing), as a reload
  from disk does.
- An update answers ``complete``: whether the updates since the sidecar's
  ``epoch`` last changed (it changes it whenever the weights are lost: a level-2
  sleep, a failed load; and the worker starts with none) have together written
  every tensor of the checkpoint, so that a trainer's buckets count together.
- ``update_weights_from_tensor`` payloads are decoded with handoff's restricted
  unpickler (:mod:`node_engine.weight_sync.tensor_payload`), never with pickle.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from handoff.checkpoint.files import shown
from handoff.protocol import errors as E
from handoff.protocol.weights import InitWeightsUpdateGroupBody
from handoff.service.errors import ServiceError
from handoff.weight_sync import JoinCancelled, is_collective_timeout
from node_engine.weight_sync.group import WeightGroup, join_group, receive, unaligned
from node_engine.weight_sync.tensor_payload import decode_payload
from node_engine.weight_sync.unpickler import UnsafePayload
from node_sidecar.engines.checkpoint import read_checkpoint

SCRATCH_FACTOR = 2  # a refused update's broadcasts are still received when they fit in this many model sizes


def _kind_of(exc: Exception, *, otherwise: str) -> str:
    """torch.distributed reports a store, rendezvous or collective timeout only in words (one rule for both ends:
    :func:`handoff.weight_sync.is_collective_timeout`)."""
    return E.WEIGHT_SYNC_TIMEOUT.name if is_collective_timeout(exc) else otherwise


def _failed(error: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": error, "message": message, **extra}


class _Join:
    """A join under way on its own thread."""

    def __init__(self, body: InitWeightsUpdateGroupBody, timeout_s: float) -> None:
        self.cancel = threading.Event()
        self.group: WeightGroup | None = None
        self.error: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, args=(body, timeout_s), daemon=True,
                                       name=f"handoff-join-{body.group_name}")

    def _run(self, body: InitWeightsUpdateGroupBody, timeout_s: float) -> None:
        try:
            self.group = join_group(body, timeout_s, self.cancel)
        except JoinCancelled:
            self.error = _failed(E.CONFLICT.name, f"the join of group {body.group_name!r} was abandoned")
        except (RuntimeError, ValueError, OSError) as exc:  # a store or rendezvous timeout is a RuntimeError
            kind = _kind_of(exc, otherwise=E.INVALID_REQUEST.name)
            self.error = _failed(kind, f"failed to join group {body.group_name!r} at {body.master_address}:"
                                       f"{body.master_port} as rank {body.rank_offset} of {body.world_size}: {exc}")


class HandoffWeightSync:
    """Mixed into vLLM's worker; every name starts with ``handoff_`` (vLLM refuses names its worker has)."""

    def _handoff_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_handoff")
        if state is None:
            state = self.__dict__["_handoff"] = {"groups": {}, "joins": {}, "shapes": None, "shapes_of": None,
                                                 "epoch": None, "written": set(), "staged": None}
        return state

    # -- the group -------------------------------------------------------------------------------------------
    def handoff_join_group(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Start joining (answers at once); :meth:`handoff_weight_group` says how it went."""
        state = self._handoff_state()
        init = InitWeightsUpdateGroupBody.model_validate(body)
        name = init.group_name
        if init.backend != "gloo" and str(self.device_config.device) == "cpu":
            return _failed(E.INVALID_REQUEST.name,
                           f"backend {init.backend} needs CUDA; this vLLM runs on CPU, use gloo")
        if name in state["groups"] or name in state["joins"]:
            return _failed(E.CONFLICT.name, f"group {name!r} exists or is being joined; destroy it first")
        join = state["joins"][name] = _Join(init, float(timeout_s))
        join.thread.start()
        return {"ok": True, "joining": name}

    def handoff_weight_group(self, group_name: str) -> dict[str, Any]:
        """``{"ok": true, "state": "joining" | "joined", ...}``, or the join's failure (reported once)."""
        state = self._handoff_state()
        join = state["joins"].get(group_name)
        if join is None:
            group = state["groups"].get(group_name)
            if group is None:
                return _failed(E.INVALID_REQUEST.name, f"group {group_name!r} does not exist")
            return {"ok": True, "state": "joined", "rank": group.rank, "world_size": group.world_size}
        if join.thread.is_alive():
            return {"ok": True, "state": "joining"}
        del state["joins"][group_name]
        if join.group is None:
            return join.error or _failed(E.ENGINE_FAILED.name,
                                         f"the join of group {group_name!r} ended without a group")
        state["groups"][group_name] = join.group
        return {"ok": True, "state": "joined", "rank": join.group.rank, "world_size": join.group.world_size}

    def handoff_leave_group(self, group_name: str) -> dict[str, Any]:
        state = self._handoff_state()
        join = state["joins"].pop(group_name, None)
        if join is not None:  # its thread destroys the group if the join ever completes
            join.cancel.set()
            return {"ok": True, "message": f"The join of group {group_name!r} was abandoned."}
        group = state["groups"].pop(group_name, None)
        if group is None:
            return _failed(E.INVALID_REQUEST.name, f"group {group_name!r} does not exist")
        group.destroy()
        return {"ok": True, "message": "Succeeded to destroy custom process group."}

    # -- updates ---------------------------------------------------------------------------------------------
    def handoff_update_from_distributed(self, group_name: str, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], flattened: bool = False,
                                        refused: str | None = None, epoch: str | None = None,
                                        stage: bool = False) -> dict[str, Any]:
        """Receive the broadcasts, then load (or ``stage``) them; ``refused`` (why, decided by the sidecar) or a
        failed check: received and discarded, nothing loaded (the trainer broadcasts whatever the answer)."""
        self._handoff_state()["staged"] = None
        group = self._handoff_state()["groups"].get(group_name)
        if group is None:
            return _failed(E.INVALID_REQUEST.name,
                           f"group {group_name!r} does not exist; call init_weights_update_group "
                           "first")
        if group.broken is not None:
            return _failed(E.WEIGHT_SYNC_BROKEN.name,
                           f"group {group_name!r} is out of step: {group.broken}; destroy it "
                           "and join again")
        sizes = [_nbytes(dtype, shape) for dtype, shape in zip(dtypes, shapes, strict=True)]
        problem = (refused or self._handoff_check(names, shapes, dtypes)
                   or (unaligned(names, dtypes, shapes) if flattened else None))
        if problem is not None and (None in sizes or sum(sizes) > SCRATCH_FACTOR * self._handoff_model_bytes()):
            group.broken = f"an update it could not receive was refused ({problem})"
            return _failed(E.INVALID_REQUEST.name,
                           f"{problem}; its broadcasts cannot be received and discarded, so group "
                           f"{group_name!r} is now out of step: destroy it and join again")
        try:
            device = getattr(self, "device", None)  # nccl receives there (a CUDA worker's device); gloo into CPU
            received = receive(group, names, dtypes, shapes, flattened=flattened, keep=problem is None,
                               device=device if isinstance(device, torch.device) else torch.device("cpu"))
        except (RuntimeError, ValueError) as exc:
            group.broken = f"a broadcast failed ({exc})"
            kind = _kind_of(exc, otherwise=E.WEIGHT_SYNC_BROKEN.name)
            return _failed(kind, f"receiving {len(names)} tensor(s) on group {group_name!r} failed: {exc}; nothing "
                                 "was loaded and the group is out of step (destroy it and join again)")
        if problem is not None:
            return _failed(E.INVALID_REQUEST.name,
                           f"{problem}; the broadcasts were received and discarded, nothing was "
                           "loaded")
        return self._handoff_stage(received) if stage else self._handoff_load(received, epoch)

    def handoff_update_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None,
                                   release_sender_reference: bool = True, epoch: str | None = None,
                                   stage: bool = False) -> dict[str, Any]:
        """Decode (never twice: a decode releases the sender's reference), check, then load or ``stage``."""
        self._handoff_state()["staged"] = None
        try:
            named = decode_payload(serialized_named_tensors, load_format,
                                   release_sender_reference=release_sender_reference)
        except UnsafePayload as exc:
            return _failed(E.INVALID_REQUEST.name, f"the tensor payload was refused, nothing was loaded: {exc}")
        problem = self._handoff_check([n for n, _ in named], [list(t.shape) for _, t in named],
                                      [str(t.dtype).removeprefix("torch.") for _, t in named])
        if problem is not None:
            return _failed(E.INVALID_REQUEST.name, f"{problem}; nothing was loaded")
        return self._handoff_stage(named) if stage else self._handoff_load(named, epoch)

    def _handoff_stage(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        self._handoff_state()["staged"] = named
        return {"ok": True, "staged": len(named)}

    def handoff_load_staged(self, epoch: str | None = None) -> dict[str, Any]:
        """Load the update staged last (checked already); answers as an update does."""
        state = self._handoff_state()
        named, state["staged"] = state["staged"], None
        if named is None:
            return _failed(E.CONFLICT.name, "no update is staged (it was dropped or replaced); nothing was loaded")
        return self._handoff_load(named, epoch)

    def handoff_drop_staged(self) -> dict[str, Any]:
        """Forget a staged update (its tensors are freed)."""
        self._handoff_state()["staged"] = None
        return {"ok": True}

    def _handoff_load(self, named: list[tuple[str, torch.Tensor]], epoch: str | None) -> dict[str, Any]:
        """vLLM's in-place reload with these tensors (checkpoint format), the disk reload's own path; ``complete``:
        the loads since ``epoch`` began wrote every tensor of the checkpoint."""
        state = self._handoff_state()
        if state["epoch"] != epoch:  # the weights were lost since: what was written before no longer counts
            state["epoch"], state["written"] = epoch, set()
        try:
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        except Exception as exc:  # any failure part way (a TypeError, IndexError, ...) leaves the weights half-loaded
            state["written"] = set()
            return _failed(E.ENGINE_FAILED.name,
                           f"vLLM's load of {len(named)} tensor(s) failed part way; its weights are "
                           f"not usable until a reload succeeds: {exc}", weights_lost=True)
        state["written"].update(name for name, _ in named)
        return {"ok": True, "loaded": len(named), "complete": state["written"] >= set(self._handoff_shapes())}

    # -- the check -------------------------------------------------------------------------------------------
    def _handoff_shapes(self) -> dict[str, list[int]]:
        """The served checkpoint's tensors (re-read after a reload from another folder)."""
        state = self._handoff_state()
        folder = str(self.vllm_config.model_config.model)
        if state["shapes_of"] != folder:
            tensors = read_checkpoint(folder).tensors  # the sidecar's bounded reading of the headers
            state["shapes"], state["shapes_of"] = {name: list(shape) for name, shape in tensors.items()}, folder
        return state["shapes"]

    def _handoff_model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model_runner.get_model().parameters())

    def _handoff_check(self, names: list[str], shapes: list[list[int]], dtypes: list[str]) -> str | None:
        """What is wrong with the announced tensors, or None (metadata only, nothing allocated)."""
        try:
            known = self._handoff_shapes()
        except (OSError, ServiceError) as exc:
            return f"the served checkpoint's tensors cannot be read to check the update: {exc}"
        if len(set(names)) != len(names):
            return "a tensor is named twice"
        for name, shape, dtype in zip(names, shapes, dtypes, strict=True):
            if name not in known:
                return f"{shown(name)} is not a tensor of this model"  # the caller's name: cut, never echoed whole
            if list(shape) != known[name]:
                return f"{name}: shape {list(shape)} does not match the model's {known[name]}"
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
                return f"{name}: dtype {shown(repr(dtype))} is not a floating torch dtype"
        fused = getattr(self.model_runner.get_model(), "packed_modules_mapping", {}) or {}
        sent = set(names)
        layers = {_layer_of(name, fused) for name in names}
        for name in sorted(known):
            if name not in sent and _layer_of(name, fused) in layers:
                return (f"{name} is missing: vLLM loads the layer {_layer_of(name, fused)} whole, so an update that "
                        "sends part of it must send all of it")
        return None


def _layer_of(name: str, fused: dict[str, list[str]]) -> str:
    """The vLLM layer a checkpoint tensor loads into (``...q_proj.weight`` -> ``...qkv_proj``)."""
    module = name.rpartition(".")[0]
    head, _, last = module.rpartition(".")
    for packed, parts in fused.items():
        if last in parts:
            return f"{head}.{packed}" if head else packed
    return module


def _nbytes(dtype: str, shape: list[int]) -> int | None:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or any(not isinstance(d, int) or d < 0 for d in shape):
        return None
    return torch_dtype.itemsize * torch.Size(shape).numel()
