"""The upstream client's errors, grouped by what the caller must do.

Every failure a peer or a configured URL can cause is one of these, never a
bare ``ValueError``, ``KeyError`` or ``UnicodeError``: a fan-out always gets one
result per node.

- :class:`ConnectFailed` (and :class:`ConnectTimedOut`, :class:`InvalidURL`):
  the peer saw nothing; the request may go to another peer.
- :class:`UpstreamTimeout`, :class:`ConnectionDropped`, :class:`ProtocolError`,
  :class:`ResponseTooLarge`: the peer may have acted on the request; answer
  502/504 naming it. (An :class:`UpstreamTimeout` that is a
  :class:`TimedOutConnecting` came before anything was sent.)
- :class:`InvalidHeader`, :class:`ClientClosed`: this process's own request or
  state; nothing was sent.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """A request to a peer failed; ``url`` names the request."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class ConnectFailed(UpstreamError):
    """The connection could not be made (refused, unreachable, unresolvable): the peer saw nothing."""


class ConnectTimedOut(ConnectFailed):
    """The connection was not made within the client's connect timeout (a partition, a dead host that
    drops packets): nothing was sent, so the peer saw nothing either."""


class InvalidURL(ConnectFailed):
    """The URL cannot be requested (not ``http://``, a bad host or port, a target with spaces or
    non-ASCII): nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """The request's deadline passed before the response was complete."""


class TimedOutConnecting(UpstreamTimeout):
    """The request's deadline passed while its connection was being made (the client has no connect timeout, or
    a longer one): nothing was sent, so the peer cannot have acted on it."""


class ConnectionDropped(UpstreamError):
    """The peer closed or reset the connection before the response was complete."""


class ProtocolError(UpstreamError):
    """The peer answered something that is not valid HTTP/1.1, or passed a head cap (size, field count)."""


class ResponseTooLarge(UpstreamError):
    """The body passed the reader's cap (:meth:`UpstreamResponse.read_whole`); ``max_bytes`` says which."""

    def __init__(self, message: str, *, url: str = "", max_bytes: int = 0) -> None:
        super().__init__(message, url=url)
        self.max_bytes = max_bytes


class InvalidHeader(UpstreamError):
    """A request header or the method cannot be written as HTTP/1.1 (a line break, a NUL, a name that
    is not a token, a character outside latin-1): nothing was sent."""


class ClientClosed(UpstreamError):
    """The client was closed; no request can start."""
