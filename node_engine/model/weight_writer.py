"""Weight updates as the model's parameters see them: checked, staged, then written in place.

The oneDNN-packed projections (``packing.py``): one that an update writes
whole (every checkpoint key of it: ``q_proj``, ``k_proj`` and ``v_proj`` for
``qkv_proj``) is packed again straight from the update's tensors; the others it
writes are unpacked before the write and packed again after it. SGLang's update
session (``begin_weight_update`` .. ``end_weight_update``) keeps every weight
plain until it ends, so its buckets only copy.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from node_engine.model.checkpoint_io import CheckpointReader, TensorEntry
from node_engine.model.projection import Projection
from node_engine.model.llama import CausalLM
from node_engine.model.loader import apply_staged, check_update, stage_update, touched_parameters
from node_engine.model.packing import WeightPacking


class WeightWriter:
    def __init__(self, model: CausalLM, packing: WeightPacking, reader: CheckpointReader,
                 source_dtypes: dict[str, torch.dtype]) -> None:
        """``source_dtypes``: each checkpoint key's dtype as first loaded (a reload must match it)."""
        self._model = model
        self._packing = packing
        self._reader = reader
        self._source_dtypes = source_dtypes
        names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
        packable = {names[id(p.weight)]: p for p in packing.projections}
        self._keys_of: dict[Projection, list[str]] = {}  # each packable projection's checkpoint keys, top row first
        for key, target in sorted(model.hf_weight_map().items(), key=lambda item: item[1].row_start or 0):
            if target.param_name in packable:
                self._keys_of.setdefault(packable[target.param_name], []).append(key)

    @property
    def is_session_open(self) -> bool:
        """SGLang's update session is open (the packing holds the weights plain for it)."""
        return self._packing.is_held_plain

    def check(self, folder: Path) -> dict[str, TensorEntry]:
        """Headers only; any thread (reads the parameters' shapes, never their storage)."""
        return check_update(self._model, folder, self._source_dtypes, self._reader)

    def stage(self, entries: dict[str, TensorEntry], into: dict[str, torch.Tensor],
              cancel: threading.Event | None = None, *, on_device: bool = False) -> None:
        """Every tensor of a checked reload, read into ``into`` in host memory (``on_device``: onto the GPU where
        it fits, :func:`~node_engine.model.loader.stage_update`); any thread."""
        stage_update(self._model, entries, self._reader, into, cancel, on_device=on_device)

    def apply(self, tensors: dict[str, torch.Tensor], *, is_complete: bool) -> None:
        """Copy checked tensors into the parameters; engine thread only.

        ``is_complete``: every weight is written, so packed projections need not be written back first.
        """
        whole = {} if self.is_session_open else {
            projection: [tensors[key] for key in keys] for projection, keys in self._keys_of.items()
            if all(key in tensors for key in keys)}
        repacked = self._packing.repack_from(whole)
        written = {key for projection in repacked for key in self._keys_of[projection]}
        rest = {key: tensor for key, tensor in tensors.items() if key not in written}
        self._packing.unpack(keep_contents=not is_complete, only=touched_parameters(self._model, list(rest)))
        try:
            apply_staged(self._model, rest)
        finally:
            if not self.is_session_open:
                self._packing.try_pack()
        if next(self._model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()

    def open_session(self) -> None:
        """SGLang's ``begin_weight_update``: plain weights until the session ends (a resume meanwhile too).

        An unpack that fails (out of memory) opens no session: the projections it reached stay plain, the
        others packed, and updates go on as outside a session."""
        self._packing.unpack()
        self._packing.hold_plain(True)

    def close_session(self) -> None:
        """SGLang's ``end_weight_update``: the weights are packed again (released ones when they resume)."""
        self._packing.hold_plain(False)
        self._packing.try_pack()
