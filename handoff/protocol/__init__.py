"""The contract the three processes share: one definition of every name on the wire.

Torch-free and FastAPI-free (pydantic only), so the LB, the sidecar, the engine
and the Python client import it alike:

- :mod:`handoff.protocol.tags`: memory tags, their states, backup modes, tag-list parsing.
- :mod:`handoff.protocol.errors`: every error type with its HTTP status, and why a node does not serve.
- :mod:`handoff.protocol.control`: the bodies of the control calls.
- :mod:`handoff.protocol.sse`: server-sent-event framing.
- :mod:`handoff.protocol.engines`: the kinds of engine behind a sidecar.
- :mod:`handoff.protocol.image_source`: what an image item points at (its bytes, a local file, the network).

A name used on the wire by more than one process is defined here and nowhere else.
"""

from __future__ import annotations
