"""What a peer's host may be, written once for every place that takes one (a node URL's authority, a trainer's
``master_address``): a DNS name of ASCII letters, digits, ``-``, ``_`` and dots (an IPv4 address is one), or
an IPv6 address without a zone index (a zone names a local interface, never a cluster peer)."""

from __future__ import annotations

import ipaddress
import re

__all__ = ["MAX_HOST_NAME_CHARS", "is_host_name", "is_ipv6_address"]

MAX_HOST_NAME_CHARS = 253
_HOST_NAME = re.compile(r"(?:[A-Za-z0-9_-]{1,63}\.)*[A-Za-z0-9_-]{1,63}\.?")


def is_host_name(text: str) -> bool:
    return len(text) <= MAX_HOST_NAME_CHARS and _HOST_NAME.fullmatch(text) is not None


def is_ipv6_address(text: str) -> bool:
    if "%" in text:
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True
