"""What a peer's host may be, written once for every place that takes one (a node URL's authority on the LB
and in the upstream client, a trainer's ``master_address``): a DNS name whose labels are ASCII letters,
digits, ``-`` and ``_`` and do not begin or end with ``-`` (an IPv4 address is one), or an IPv6 address
without a zone index (a zone names a local interface, never a cluster peer).

:func:`canonical_host` also spells a host one way, so two spellings of one address compare equal: a name the
resolver reads as a number (``inet_aton``'s forms: ``0``, ``127.1``, ``0x7f.0.0.1``) is the IPv4 address it is.
"""

from __future__ import annotations

import ipaddress
import re
import socket

__all__ = ["MAX_HOST_NAME_CHARS", "canonical_host", "canonical_ip", "is_host_name", "is_ipv6_address"]

MAX_HOST_NAME_CHARS = 253
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}\.?")


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


def canonical_ip(text: str) -> str:
    """An IP address in its compressed form; an IPv4-mapped IPv6 address as the IPv4 address.

    Raises ``ValueError`` for anything else, a zone index included."""
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            raise ValueError(f"{text!r}: IPv6 zone ids are not supported")
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
    return str(address)


def canonical_host(host: str) -> str:
    """``host`` (an IPv6 literal in brackets or not) as a compressed IP without brackets or a lowercase name
    without its final dot. Raises ``ValueError`` saying what is wrong with it."""
    if not host:
        raise ValueError("no host")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"unterminated IPv6 literal {host[:80]!r}")
        literal = host[1:-1]
        if not is_ipv6_address(literal):
            raise ValueError(f"{literal[:80]!r} is not an IPv6 address without a zone index")
        return canonical_ip(literal)
    if not host.isascii() or not host.isprintable():
        raise ValueError("the host must be printable ASCII (write an international name in its xn-- form)")
    try:
        return canonical_ip(host)
    except ValueError:
        if not is_host_name(host):  # not an IP address: it must be a name
            raise ValueError(f"{host[:80]!r} is not a host name or an IP address") from None
    name = host.lower().removesuffix(".")
    try:  # getaddrinfo reads these forms as numbers, never looks them up: "0" is 0.0.0.0, "127.1" 127.0.0.1
        return socket.inet_ntoa(socket.inet_aton(name))
    except OSError:
        return name
