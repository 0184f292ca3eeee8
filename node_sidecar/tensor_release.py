"""The sender's shared memory of a tensor push the sidecar refused before its engine read it.

torch counts one reader per serialized CPU tensor: the sender takes a reference
to each shared-memory segment as it pickles, and the reader releases it. A push
refused before the engine reads it (a drain that timed out: 409 ``drain_timeout``;
a bad field: 400) would leave that reference held, and the segment in the sender's
``/dev/shm`` until the sender exits, even after it let go of its tensors: a
bucket's size per refused push of fresh tensors. So on such a refusal the sidecar
has its engine read the payload and load nothing (``dry_run``), where the engine
can (handoff's). A push cut before the engine read it (its task cancelled: a
graceful shutdown past ``--shutdown-timeout``) has it read the same way by a task
of :class:`UnreadReleases`, which outlives the request and which the sidecar's
shutdown waits for (bounded by the engine client's ``--control-timeout``).
Nothing is read for a caller that failed the admin check, for a body whose own
payload fields are malformed, or with the engine down.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from handoff.protocol.weights import MAX_TENSOR_PAYLOADS, TensorLoadFormat
from handoff.service.errors import ServiceError
from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_sidecar.control import ControlPlane

log = logging.getLogger(__name__)


class _PayloadFields(BaseModel):
    """The fields that say how to read a push's payload, from a body refused for another of its fields."""

    model_config = ConfigDict(extra="ignore", strict=True)
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=MAX_TENSOR_PAYLOADS)
    load_format: TensorLoadFormat | None = None
    release_sender_reference: bool = True


def payload_fields(raw: bytes) -> dict[str, Any] | None:
    """How to read the payload of a body that did not validate; None when that cannot be told."""
    try:
        value = loads_bounded(raw)
        return _PayloadFields.model_validate(value).model_dump() if isinstance(value, dict) else None
    except (PeerJSONError, ValidationError):
        return None


async def release_unread(control: ControlPlane, fields: dict[str, Any]) -> None:
    """Have the engine read the payload of a refused push (and load nothing), so that the sender's reference is
    released; best effort: a failure is logged and the refusal stands as it was."""
    if fields.get("release_sender_reference") is False:
        return  # another node of the push releases it
    body = {key: fields[key] for key in ("serialized_named_tensors", "load_format") if key in fields}
    try:
        control.node.require_engine()
        await control.node.engine_adapter.check_tensor_payload(body)
    except ServiceError as exc:
        log.info("a refused tensor push was not read, its sender keeps its shared memory until it exits: %s",
                 str(exc)[:300])


class UnreadReleases:
    """:func:`release_unread` for pushes cancelled before the engine read them, run as tasks that outlive the
    request; the sidecar keeps them here until they end, and waits for them before it closes its engine client."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, control: ControlPlane, fields: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(release_unread(control, fields), name="release-unread-push")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a cut tensor push was not read, its sender keeps its shared memory until it exits",
                      exc_info=task.exception())

    async def wait(self) -> None:
        """Until every release scheduled so far has ended (each bounded by the engine client's timeouts)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
