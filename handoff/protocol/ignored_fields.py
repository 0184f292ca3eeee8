"""Unknown fields of the OpenAI bodies, taken as SGLang 0.5.23 takes them: dropped unread.

SGLang's OpenAI request models (``entrypoints/openai/protocol.py``: ``ChatCompletionRequest``,
``CompletionRequest``, ``StreamOptions``, the message, content-part and tool models) are pydantic models at
pydantic's default, ``extra="ignore"``: a field they do not declare (OpenAI's ``store``, ``metadata``,
``service_tier``; a vLLM extra such as ``include_stop_str_in_output``) is dropped, and the request runs as if it
were not there. So are this engine's models (:data:`IGNORE_UNKNOWN`): a dropped field is never stored on the
model, so no ``model_dump`` nor any copy into the ``/generate`` request can carry it. The fields they do declare
keep their strict types.

Each dropped name is logged once at WARNING (the first :data:`MAX_LOGGED_NAMES` names of the process, each cut to
:data:`MAX_NAME_CHARS` characters), so a misspelt field (``temprature``) shows in the log without a client able to
fill it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar, Iterable

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["IGNORE_UNKNOWN", "IgnoresUnknown", "MAX_LOGGED_NAMES", "MAX_NAME_CHARS", "note_ignored"]

log = logging.getLogger(__name__)

# SGLang's models drop what they do not declare (pydantic's default); the declared fields are typed strictly here
IGNORE_UNKNOWN = ConfigDict(extra="ignore", strict=True)
MAX_LOGGED_NAMES = 64
MAX_NAME_CHARS = 64

_logged: set[str] = set()
_lock = threading.Lock()


def note_ignored(where: str, names: Iterable[str]) -> None:
    """Log each of ``names`` (fields of ``where`` that are dropped) not logged before, while fewer than
    :data:`MAX_LOGGED_NAMES` are: past them, one last line says so, and nothing more is read."""
    for name in names:
        shown = name[:MAX_NAME_CHARS] + ("..." if len(name) > MAX_NAME_CHARS else "")
        with _lock:
            if len(_logged) > MAX_LOGGED_NAMES:
                return
            if shown in _logged:
                continue
            _logged.add(shown)
            full = len(_logged) > MAX_LOGGED_NAMES
        if full:
            log.warning("more unknown fields were ignored; their names are not logged")
            return
        log.warning("%s: ignored unknown field %r, as SGLang 0.5.23 ignores it (each name is logged once)",
                    where, shown)


class IgnoresUnknown(BaseModel):
    """A model that drops the fields it does not declare, as SGLang's, and logs their names
    (:func:`note_ignored`). ``ignored_where`` names the model in the log. A subclass's own ``before``
    validators run first, so a field one of them reads and removes (chat's ``reasoning``) is not logged."""

    model_config = IGNORE_UNKNOWN
    ignored_where: ClassVar[str] = "body"

    @model_validator(mode="before")
    @classmethod
    def _note_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            note_ignored(cls.ignored_where, (key for key in data if isinstance(key, str) and key not in fields))
        return data
