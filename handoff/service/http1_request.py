"""The request side of :mod:`handoff.service.upstream`: URLs checked before any socket, request heads.

A URL is ``http://HOST[:PORT][/target]`` where HOST is a DNS name, an IPv4
address or a bracketed IPv6 address; anything else (``http://[::1``, a
non-ASCII or NUL host, a port past 65535, a space in the target) is an
:class:`InvalidURL`, so the resolver and the socket layer only ever see names
they accept. Header names must be tokens and values free of CR, LF and NUL.
"""

from __future__ import annotations

import functools
import re
from typing import Iterable, Mapping, Union

from handoff.protocol.hosts import is_host_name, is_ipv6_address
from handoff.service.upstream_errors import InvalidHeader, InvalidURL

Headers = Union[Mapping[str, str], Iterable[tuple[str, str]]]

_TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_PORT = re.compile(r"[0-9]{1,5}")
_TARGET = re.compile(r"/[\x21-\x7e]*")
_BAD_VALUE_CHARS = re.compile(r"[\r\n\x00]")
# set by the client from the request itself; a caller's copy would make two framings
_CLIENT_OWNED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_BODILESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


class Origin:
    """Where to connect, and the ``Host`` header that names it."""

    __slots__ = ("host", "port", "host_header")

    def __init__(self, host: str, port: int, host_header: str) -> None:
        self.host = host
        self.port = port
        self.host_header = host_header


@functools.lru_cache(maxsize=4096)
def parse_origin(authority: str) -> Origin:
    """``host[:port]`` or ``[v6]:port`` -> :class:`Origin`; raises :class:`InvalidURL`."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise InvalidURL(f"bad IPv6 address in {authority!r}: no closing ']'")
        host, rest = authority[1:end], authority[end + 1:]
        if rest and not rest.startswith(":"):
            raise InvalidURL(f"unexpected {rest!r} after the IPv6 address in {authority!r}")
        port_text = rest[1:]
        if not is_ipv6_address(host):
            raise InvalidURL(f"bad IPv6 address in {authority[:100]!r}")
    else:
        host, _, port_text = authority.partition(":")
        if not host:
            raise InvalidURL("URL has no host")
        if not is_host_name(host):
            raise InvalidURL(f"bad host {host[:80]!r}: a DNS name (ASCII letters, digits, '-', '_', '.') "
                             f"or an IP address")
    if port_text and not _PORT.fullmatch(port_text):
        raise InvalidURL(f"bad port {port_text[:20]!r} in {authority[:100]!r}")
    port = int(port_text) if port_text else 80
    if not 0 < port < 65536:
        raise InvalidURL(f"bad port {port} in {authority[:100]!r}")
    return Origin(host, port, authority)


@functools.lru_cache(maxsize=4096)  # a process calls the same few node URLs over and over (a fan-out: 128 at once)
def split_url(url: str) -> tuple[Origin, str]:
    """``http://host:port/path?q`` -> (origin, ``/path?q``). Raises :class:`InvalidURL` (never cached)."""
    if not url.startswith("http://"):
        raise InvalidURL(f"only http:// URLs are supported, got {url[:100]!r}", url=url)
    rest = url[7:]
    cut = len(rest)
    for sep in "/?":
        at = rest.find(sep)
        if 0 <= at < cut:
            cut = at
    target = rest[cut:] or "/"
    if target.startswith("?"):
        target = "/" + target
    if not _TARGET.fullmatch(target):
        raise InvalidURL(f"bad request target {target[:100]!r}: only visible ASCII", url=url)
    try:
        return parse_origin(rest[:cut]), target
    except InvalidURL as exc:
        exc.url = url
        raise


@functools.lru_cache(maxsize=1024)  # per line too: a set with a per-request value (a request id) misses below
def _header_line(name: str, value: str) -> str:
    if not _TOKEN.fullmatch(name) or name.lower() in _CLIENT_OWNED_HEADERS:
        raise InvalidHeader(f"header name {name[:40]!r} is not a token, or is set by the client")
    if _BAD_VALUE_CHARS.search(value):
        raise InvalidHeader(f"header {name!r} contains a line break or NUL")
    return f"{name}: {value}\r\n"


@functools.lru_cache(maxsize=1024)  # the same few sets of headers go with most requests (a fan-out: one set)
def _header_lines(items: tuple[tuple[str, str], ...]) -> str:
    return "".join([_header_line(name, value) for name, value in items])


def encode_head(method: str, target: str, origin: Origin, headers: Headers | None, body_length: int) -> bytes:
    """The request line and headers, with ``Content-Length`` unless a bodiless GET/HEAD/DELETE/OPTIONS.

    Raises :class:`InvalidHeader` for a method or header that cannot be written.
    """
    if not _TOKEN.fullmatch(method):
        raise InvalidHeader(f"bad method {method[:40]!r}")
    lines = ""
    if headers:
        items = headers.items() if isinstance(headers, (dict, Mapping)) else headers
        try:
            lines = _header_lines(tuple(items))
        except TypeError as exc:  # a name or value that is not a string (unhashable): as the check would say
            raise InvalidHeader(f"a header name or value is not a string: {exc}") from exc
    length = f"Content-Length: {body_length}\r\n" if body_length or method not in _BODILESS_METHODS else ""
    try:
        return f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n{lines}{length}\r\n".encode("latin-1")
    except UnicodeEncodeError as exc:
        raise InvalidHeader(f"a header holds characters outside latin-1: {exc}") from exc
