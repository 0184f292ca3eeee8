"""Logging for every handoff process: one line per event, text or JSON.

Secrets (admin token, API key) are registered with :func:`setup_logging` and
replaced by ``***`` in every line written, as a last line of defence: the code
never formats a token into a message in the first place. The whole formatted
line is redacted (message, extra fields, traceback), in JSON in its escaped
form too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Iterable

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _Redactor(logging.Filter):
    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self._secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        if self._secrets:
            message = record.getMessage()
            redacted = message
            for secret in self._secrets:
                redacted = redacted.replace(secret, "***")
            if redacted != message:
                record.msg, record.args = redacted, None
        return True


class _RedactingFormatter(logging.Formatter):
    """Formats with ``inner``, then hides every secret in the finished line (tracebacks and extra fields
    included, which a filter on the record's message cannot reach)."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str]) -> None:
        super().__init__()
        self._inner = inner
        forms = {form for secret in secrets if secret for form in (secret, json.dumps(secret)[1:-1])}
        self._forms = sorted(forms, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        line = self._inner.format(record)
        for form in self._forms:
            line = line.replace(form, "***")
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                event[key] = value
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname:<7} {self.service} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, *, fmt: str = "text", level: str = "info",
                  secrets: Iterable[str] = ()) -> None:
    """Configure the root logger (and uvicorn's) for one process."""
    secrets = [s for s in secrets if s]
    handler = logging.StreamHandler(sys.stderr)
    formatter: logging.Formatter = JsonFormatter(service) if fmt == "json" else TextFormatter(service)
    handler.setFormatter(_RedactingFormatter(formatter, secrets) if secrets else formatter)
    handler.addFilter(_Redactor(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
