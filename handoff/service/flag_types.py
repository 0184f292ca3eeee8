"""argparse types of the flags every service shares: a bad value is argparse's one-line error naming the flag
(exit 2), before anything is loaded or bound."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

__all__ = ["MAX_SECONDS", "host_name", "path", "port_file", "port_number", "positive_int", "positive_seconds",
           "seconds", "seconds_problem", "state_file"]


def port_number(text: str) -> int:
    """A port: 0-65535, in ASCII digits (int() reads other scripts' digits too, which no one means as a port)."""
    if not (text.isascii() and text.isdigit()) or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number in 0-65535, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """A whole number, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number >= 1, got {text!r}")
    return value


MAX_SECONDS = 7 * 24 * 3600.0
"""The longest timeout or interval any flag or client call takes (a week). Past it a value means "never" without
saying so, and some waits overflow: ``threading`` past 2**33 s, ``timedelta`` (a weight group's) past 1e14 s."""


def seconds_problem(value: object, *, allow_zero: bool = False) -> str | None:
    """Why ``value`` is not a number of seconds a timeout may take, or None when it is: a finite number above 0
    (0 too with ``allow_zero``) and at most :data:`MAX_SECONDS`. The one rule of flags, configs and the client."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and (0 < value <= MAX_SECONDS or (allow_zero and value == 0)):
        return None
    lowest = "0 or more" if allow_zero else "above 0"
    return f"a number of seconds {lowest} and at most {MAX_SECONDS:g} (a week), got {value!r}"


def seconds(text: str) -> float:
    """A number of seconds, 0 to :data:`MAX_SECONDS`."""
    return _seconds(text, allow_zero=True)


def positive_seconds(text: str) -> float:
    """A number of seconds above 0, at most :data:`MAX_SECONDS`."""
    return _seconds(text, allow_zero=False)


def _seconds(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, got {text!r}") from None
    problem = seconds_problem(value, allow_zero=allow_zero)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem.replace(f"got {value!r}", f"got {text!r}"))
    return value


def host_name(text: str) -> str:
    """An address to bind. Blank is refused: the socket layer takes ``""`` for every interface, which would
    open a service meant for localhost (the engine's default) to the network."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an address to bind (0.0.0.0 for every interface), got a blank one")
    return text


def port_file(text: str) -> Path:
    """Where the bound port is written: a file in a folder this process can write in (checked now, so that a
    typo fails before a model loads, not after)."""
    return _writable_file(text, "a file to write the port in")


def state_file(text: str) -> Path:
    """Where a service keeps state across its restarts: a file in a folder this process can write in (it is
    replaced whole there), checked before anything serves."""
    return _writable_file(text, "a file to keep the state in")


def _writable_file(text: str, what: str) -> Path:
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{what}, got the folder {text!r}")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: this process cannot write in {str(folder)!r}")
    try:  # access() says yes to root for a read-only mount or /proc, where no file can be made
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".handoff-write-check-"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: no file can be made in {str(folder)!r} "
                                         f"({exc.strerror or exc})") from None
    return path


def path(text: str) -> Path:
    """A file or folder. Blank is refused: ``Path("")`` is the current folder, which an unset variable in a command
    line would name without a word (media read, backups written, wherever the process was started)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a path, got a blank one")
    return Path(text)
