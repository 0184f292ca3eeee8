"""argparse types of the flags every service shares: a bad value is argparse's one-line error naming the flag
(exit 2), before anything is loaded or bound."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

__all__ = ["host_name", "port_file", "port_number", "positive_int", "positive_seconds", "seconds"]


def port_number(text: str) -> int:
    """A port: 0-65535."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
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


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of seconds >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds above 0."""
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a number of seconds > 0, got {text!r}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a finite number of seconds, got {text!r}")
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
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"a file to write the port in, got the folder {text!r}")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: this process cannot write in {str(folder)!r}")
    return path
