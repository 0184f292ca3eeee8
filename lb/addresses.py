"""Node addresses: URLs checked and spelled one way when they enter the membership, and what they resolve to.

Every way a node enters (``--node``/``--prefill``/``--decode``, ``POST /nodes``,
DNS discovery) goes through :func:`canonical_url`, so a URL the LB cannot use
(a broken IPv6 literal, a non-ASCII or NUL host, a path, credentials) is a 400
or a flag error naming the problem, never a member that breaks every later
call. Two spellings of one address (``localhost`` and ``127.0.0.1``,
``HOST.`` and ``host``, ``[::ffff:10.0.0.1]`` and ``10.0.0.1``) are one node:
:func:`resolve` gives the addresses a host stands for, and the membership
refuses a second member on an address and port it already has.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Awaitable, Callable, Sequence

from handoff.protocol.hosts import canonical_host, canonical_ip
from handoff.service.redact import shown_url

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 2.0
MAX_SHOWN_URL_CHARS = 200
_LOOPBACK_NAMES = {"localhost": frozenset({"127.0.0.1", "::1"})}

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]  # (host, port) -> its addresses; raises OSError


def canonical_url(url: str) -> str:
    """``http://HOST:PORT``: lowercase name or compressed IP, explicit port. Raises ``ValueError`` naming the
    problem (scheme, credentials, path, query, host, port)."""
    if not isinstance(url, str):
        raise ValueError(f"node URL must be a string, got {type(url).__name__}")
    text = url.strip()
    url = _shown(url)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() != "http":
        raise ValueError(f"node URL must start with http://, got {url!r}")
    authority = rest.removesuffix("/")
    for char, what in (("/", "a path"), ("?", "a query"), ("#", "a fragment"), ("@", "credentials")):
        if char in authority:
            raise ValueError(f"node URL must be http://HOST[:PORT] without {what}, got {url!r}")
    if authority.startswith("["):
        end = authority.find("]")
        host, port_text = (authority, "") if end < 0 else (authority[:end + 1], authority[end + 1:])
        if port_text and not port_text.startswith(":"):
            raise ValueError(f"node URL {url!r}: unexpected {port_text[:20]!r} after the IPv6 literal")
        port_text = port_text[1:]
    else:
        host, _, port_text = authority.partition(":")
    try:
        canonical = canonical_host(host)
    except ValueError as exc:
        raise ValueError(f"node URL {url!r}: {exc}") from None
    unreachable = never_a_peer(canonical)
    if unreachable:
        raise ValueError(f"node URL {url!r}: {canonical} is {unreachable}")
    # ASCII digits only: str.isdigit takes "²" (int() refuses it) and other scripts' digits (int() reads them)
    if port_text and (not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5
                      or not 0 < int(port_text) < 65536):
        raise ValueError(f"node URL {url!r}: the port must be a number in 1-65535, got {port_text[:20]!r}")
    port = int(port_text) if port_text else 80
    return f"http://[{canonical}]:{port}" if ":" in canonical else f"http://{canonical}:{port}"


def _shown(url: str) -> str:
    """``url`` as a refusal shows it: a password not written out, at most ``MAX_SHOWN_URL_CHARS`` of it (a
    megabyte URL is not sent back whole)."""
    shown = shown_url(url)
    return shown if len(shown) <= MAX_SHOWN_URL_CHARS else shown[:MAX_SHOWN_URL_CHARS] + "..."


def never_a_peer(host: str) -> str | None:
    """What an address no node can be reached at is (a connection to ``0.0.0.0`` or ``::`` reaches this very host:
    the node behind ``127.0.0.1`` again, under a spelling no check can tie to it); None for a name or an address
    one node may have."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_unspecified:
        return "the address a server listens on (every interface), not one to reach a node at: give the node's own " \
               "(127.0.0.1 for a node on this host)"
    if address.is_multicast:
        return "a multicast address, not the address of one node"
    if address == ipaddress.IPv4Address("255.255.255.255"):
        return "the broadcast address, not the address of one node"
    return None


def split_canonical(url: str) -> tuple[str, int]:
    """(host, port) of a URL made by :func:`canonical_url` (IPv6 without brackets)."""
    authority = url[len("http://"):]
    host, _, port = authority.rpartition(":")
    return host.strip("[]"), int(port)


def literal_addresses(host: str) -> frozenset[str] | None:
    """The addresses of an IP literal or a loopback name, known without a lookup; None for other names."""
    if host in _LOOPBACK_NAMES:
        return _LOOPBACK_NAMES[host]
    try:
        return frozenset({canonical_ip(host)})
    except ValueError:
        return None


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6), sorted, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def resolve(host: str, lookup: Resolver | None = None, timeout_s: float = RESOLVE_TIMEOUT_S) -> frozenset[str]:
    """Every address ``host`` stands for; a name that does not resolve in time stands for none known yet.
    ``lookup`` replaces the system's resolver (tests)."""
    known = literal_addresses(host)
    if known is not None:
        return known
    try:
        found = await asyncio.wait_for((lookup or system_resolver)(host, 0), timeout_s)
        return frozenset(canonical_ip(str(address).partition("%")[0]) for address in found)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: UnicodeError, or not an address
        log.info("%s does not resolve now (%s); it is a member under its name only", host, exc)
        return frozenset()
