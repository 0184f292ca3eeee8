"""Logging for every handoff process: one line per event, text or JSON.

Secrets (admin token, API key) are registered with :func:`setup_logging` and
replaced by ``***`` in every line written, as a last line of defence: the code
never formats a token into a message in the first place. The whole formatted
line is redacted (message, extra fields, traceback), in JSON in its escaped
form too.

A text line is one line: control characters in a message (a peer's error text
with CR/LF or ANSI escapes in it) are written escaped, so no value can forge a
line of its own. A traceback follows its record on lines of its own, each
indented and escaped the same way: an exception's message (which may quote a
client's value) cannot start a line that reads as a record either; it is cut
at :data:`MAX_TRACEBACK_CHARS`. What a stranger can make a process log once
per request (uvicorn's ``Invalid HTTP request received.``, a node's failure on
the request path, a bug's traceback) goes through :class:`RateLimit`: a burst
per message, then one line saying how many were left out.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

# C0 and C1 controls, DEL and the Unicode line breaks some viewers honour: written as escapes in a text line
_LINE_BREAKERS = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]
_ESCAPES = {code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" for code in _LINE_BREAKERS}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})

MAX_TRACEBACK_CHARS = 16 * 1024
TRACEBACK_INDENT = "  | "  # a traceback's lines in a text log: never read as a record (which starts with its time)

# loggers that a stranger (a client, a node) can make write once per request; see RateLimit
RATE_LIMITED_LOGGERS = ("uvicorn.error",)


def one_line(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``): it cannot start a line of its own."""
    return text.translate(_ESCAPES)


@dataclass
class _Window:
    started: float
    num_logged: int = 0
    num_dropped: int = 0


class RateLimit(logging.Filter):
    """At most ``burst`` records of one message template (per logger) every ``window_s`` seconds; the others are
    dropped and counted, and the first record let through after a window that dropped some says how many."""

    MAX_TEMPLATES = 256  # a logger that formats its own messages makes one template each: they share one window
    DEFAULT_BURST = 10

    def __init__(self, burst: int = DEFAULT_BURST, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._windows: dict[tuple[str, str], _Window] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            window, dropped = self._window_of(record)
            if window.num_logged >= self._burst:
                window.num_dropped += 1
                return False
            window.num_logged += 1
        if dropped:
            record.msg = f"{record.getMessage()} ({dropped} more like this in the {self._window_s:g} s before " \
                         "were not logged)"
            record.args = None
        return True

    def _window_of(self, record: logging.LogRecord) -> tuple[_Window, int]:
        """The record's current window, and how many records the window it replaced dropped."""
        key = (record.name, str(record.msg))
        now = self._clock()
        if key not in self._windows and len(self._windows) >= self.MAX_TEMPLATES:
            self._forget_ended(now)
            if len(self._windows) >= self.MAX_TEMPLATES:
                key = (record.name, "")
        window = self._windows.get(key)
        if window is not None and now - window.started < self._window_s:
            return window, 0
        self._windows[key] = _Window(now)
        return self._windows[key], 0 if window is None else window.num_dropped

    def _forget_ended(self, now: float) -> None:
        for key in [k for k, w in self._windows.items() if now - w.started >= self._window_s and not w.num_dropped]:
            del self._windows[key]


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


class _BoundedTraceback(logging.Formatter):
    """A traceback cut at :data:`MAX_TRACEBACK_CHARS`: its exception's message may quote a whole request body."""

    def formatException(self, ei: Any) -> str:
        text = super().formatException(ei)
        if len(text) <= MAX_TRACEBACK_CHARS:
            return text
        return f"{text[:MAX_TRACEBACK_CHARS]}\n...({len(text) - MAX_TRACEBACK_CHARS} more characters)"


class JsonFormatter(_BoundedTraceback):
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


class TextFormatter(_BoundedTraceback):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname:<7} {self.service} {record.name}: {one_line(record.getMessage())}"
        if record.exc_info:
            line += "".join(f"\n{TRACEBACK_INDENT}{one_line(part)}"
                            for part in self.formatException(record.exc_info).split("\n"))
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
    for name in RATE_LIMITED_LOGGERS:
        rate_limit(logging.getLogger(name))


def rate_limit(logger: logging.Logger) -> None:
    """Put ``logger`` under a :class:`RateLimit` (once, however often this is called)."""
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(RateLimit())
