"""Weight updates as the model's parameters see them: checked, staged, then written in place.

The oneDNN-packed projections (``packing.py``) are undone before a write and
redone after it; a bucket unpacks only the projections it writes. SGLang's
update session (``begin_weight_update`` .. ``end_weight_update``) keeps every
weight plain until it ends, so its buckets unpack nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from node_engine.model.checkpoint_io import CheckpointReader, TensorEntry
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
        self.is_session_open = False

    def check(self, folder: Path) -> dict[str, TensorEntry]:
        """Headers only; any thread (reads the parameters' shapes, never their storage)."""
        return check_update(self._model, folder, self._source_dtypes, self._reader)

    def stage(self, entries: dict[str, TensorEntry], cancel: threading.Event | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of a checked reload, read into host memory; any thread."""
        return stage_update(self._model, entries, self._reader, cancel)

    def apply(self, tensors: dict[str, torch.Tensor], *, is_complete: bool) -> None:
        """Copy checked tensors into the parameters; engine thread only.

        ``is_complete``: every weight is written, so packed projections need not be written back first.
        """
        if is_complete:
            self._packing.unpack(keep_contents=False)
        else:
            self._packing.unpack(only=touched_parameters(self._model, list(tensors)))
        try:
            apply_staged(self._model, tensors)
        finally:
            if not self.is_session_open:
                self._packing.try_pack()
        if next(self._model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()

    def open_session(self) -> None:
        """SGLang's ``begin_weight_update``: plain weights until the session ends."""
        self.is_session_open = True
        self._packing.unpack()

    def close_session(self) -> None:
        self.is_session_open = False
        self._packing.try_pack()
