"""An engine process's memory as an adapter that remembers its own calls records it (:class:`TagRecord`), and
the shape checks of the state file's fields (:mod:`node_sidecar.intent` holds the rest of the record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handoff.protocol.control import MAX_NAME_CHARS
from handoff.protocol.tags import TAG_NAMES as TAGS

MAX_ENGINE_CHARS = 1024  # an engine process's identity (a uuid, vLLM's instance_id, SGLang's startup_time as JSON)
_LATER_MEMORY_KEYS = ("weights_garbage", "continue_held")  # keys added later: absent, read as false and null


class IntentShapeError(ValueError):
    """Stored intent that is not of the shape :meth:`ClusterIntent.to_json` writes."""


@dataclass(frozen=True)
class TagRecord:
    """What an adapter that remembers its own memory calls holds of engine process ``engine``: the tags it released
    there (``released``), those of a release or resume sent and not answered yet (``in_doubt``: the engine may
    or may not have moved them), and whether its weights are no checkpoint's (``weights_garbage``: resumed without
    a backup, or a reload failed part way; generation waits for a reload or a session of updates), and a
    ``continue_generation`` it holds back until every tag is resident and the weights valid (``continue_held``: its
    ``torch_empty_cache``; None: none held)."""

    engine: str
    released: tuple[str, ...] = ()
    in_doubt: tuple[str, ...] = ()
    weights_garbage: bool = False
    continue_held: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "released": list(self.released), "in_doubt": list(self.in_doubt),
                "weights_garbage": self.weights_garbage, "continue_held": self.continue_held}

    @classmethod
    def from_json(cls, data: object) -> TagRecord | None:
        if data is None:
            return None
        keys = ["engine", "in_doubt", "released"]  # the later keys: absent, false and null
        if not isinstance(data, dict) or sorted(k for k in data if k not in _LATER_MEMORY_KEYS) != keys:
            raise IntentShapeError("engine_memory: null or an object with the keys engine, released, in_doubt "
                                   "(and weights_garbage, continue_held)")
        engine = text_field(data["engine"], "engine_memory.engine", MAX_ENGINE_CHARS)
        if engine is None:
            raise IntentShapeError("engine_memory.engine: a string expected")
        garbage = data.get("weights_garbage", False)
        if type(garbage) is not bool:
            raise IntentShapeError("engine_memory.weights_garbage: true or false expected")
        held = data.get("continue_held")
        if held is not None and type(held) is not bool:
            raise IntentShapeError("engine_memory.continue_held: null, true or false expected")
        return cls(engine, tuple(tag_list(data, "released")), tuple(tag_list(data, "in_doubt")), garbage, held)


def text_field(value: object, name: str, max_chars: int = MAX_NAME_CHARS) -> str | None:
    """A stored field that is null or a string of 1 to ``max_chars`` characters; IntentShapeError otherwise."""
    if value is None or (isinstance(value, str) and 0 < len(value) <= max_chars):
        return value
    raise IntentShapeError(f"{name}: null or a string of 1 to {max_chars} characters expected")


def tag_list(data: dict[str, Any], name: str) -> list[str]:
    """``data[name]``: a list of distinct tag names; IntentShapeError otherwise."""
    tags = data[name]
    if not isinstance(tags, list) or not all(isinstance(t, str) and t in TAGS for t in tags) \
            or len(set(tags)) != len(tags):
        raise IntentShapeError(f"{name}: a list of distinct tags among {', '.join(TAGS)} expected")
    return tags
