"""Outputs from the engine thread to the event loop, handed over once per step.

Each output is stamped on the engine thread with the weight version that made it (a final one with the spans of
every version that made its tokens, SGLang's ``weight_versions``): the event loop may read it after a weight update
that ran on that thread in the meantime. On the event loop a final output frees its request's id.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from handoff.protocol.generation import weight_version_spans
from node_engine.request import Request, RequestOutput
from node_engine.request_gate import RequestGate


class Outbox:
    def __init__(self, gate: RequestGate, weight_version: str) -> None:
        self.gate = gate
        self.weight_version = weight_version
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand outputs to ``loop`` from now on (until then they are dropped: nothing listens)."""
        self._loop = loop

    def set_weight_version(self, version: str, live: Iterable[Request]) -> None:
        """Engine thread: stamp ``version`` from now on. The ``live`` requests (running, or paused or retracted by
        ``pause_generation``) that made tokens already remember how many the old version made (SGLang's
        ``record_weight_version_change``), for the ``weight_versions`` of their answers."""
        old = self.weight_version
        if version == old:
            return
        for request in live:
            if request.output_ids:
                request.weight_version_events.append((old, len(request.output_ids)))
        self.weight_version = version

    def deliver(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        """Stamp ``outputs`` and hand them to the event loop (from the engine thread, or any thread once closed)."""
        if outputs and self._loop is not None:
            for request, output in outputs:
                output.weight_version = self.weight_version
                if output.finish_reason is not None:
                    output.weight_versions = weight_version_spans(request.weight_version_events, self.weight_version,
                                                                  output.num_output_tokens)
                    output.weight_version = output.weight_versions[-1]["version"]
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        """Hand outputs to their requests (event loop); a final one frees its request's id."""
        for request, output in outputs:
            if output.is_final:
                self.gate.give_back(request.rid)
            request.on_output(output)
