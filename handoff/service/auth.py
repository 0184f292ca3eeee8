"""Bearer-token checks for SPEC section 6: constant-time compare, never logged."""

from __future__ import annotations

import hmac
import os

from starlette.requests import Request

from handoff.protocol.bearer import checked_token
from handoff.service.errors import Unauthorized


class BearerToken:
    """One configured token; ``None`` means the endpoints it guards are open.

    ``Authorization: <scheme> <token>`` matches when the scheme is ``Bearer`` in
    any case (RFC 9110: schemes are case-insensitive) and the token, with the
    whitespace around it dropped, is this one; the token is compared in
    constant time. ``repr`` never shows the secret, so logging the object is safe.
    """

    __slots__ = ("_expected",)

    def __init__(self, token: str | None) -> None:
        self._expected = token.strip().encode() if token and token.strip() else None

    @property
    def is_enabled(self) -> bool:
        return self._expected is not None

    def matches(self, request: Request) -> bool:
        """Whether the request carries this token (False when no token is configured)."""
        if self._expected is None:
            return False
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1", "replace"),
                                                                  self._expected)

    def check(self, request: Request, *, also: "BearerToken | None" = None) -> None:
        """Raise :class:`Unauthorized` unless the request carries the token (or ``also``'s, if given)."""
        if self._expected is None:
            return
        if self.matches(request) or (also is not None and also.matches(request)):
            return
        raise Unauthorized()

    def header(self) -> dict[str, str]:
        """The Authorization header to send to a peer that expects this token."""
        if self._expected is None:
            return {}
        return {"Authorization": f"Bearer {self._expected.decode()}"}

    def __repr__(self) -> str:
        return f"BearerToken(enabled={self.is_enabled})"


def admin_token_of(admin_token: str | None, api_key: str | None) -> str | None:
    """The token that guards control, weight and membership calls: the admin token, or, when only an API key is
    set, the API key. SGLang 0.5.23's rule for these endpoints (``AuthLevel.ADMIN_OPTIONAL``, ``utils/auth.py``):
    open only when no key at all is configured. A deployment that sets only ``--api-key``, as an SGLang server is
    started, must not leave its weights and memory open to anyone who can reach the port; and the LB, which
    sends its nodes this token, reaches sidecars configured the same way."""
    return admin_token or api_key


def token_from(flag_value: str | None, env_var: str, flag: str) -> str | None:
    """A flag wins over its environment variable; unset or empty means no token.

    Raises ``ValueError`` naming ``flag`` for a value that cannot be a bearer token as
    written: blank (it would turn the check off without a word), or holding anything
    but visible ASCII (an ``Authorization`` header could not carry it to a peer)."""
    value = flag_value or os.environ.get(env_var) or None
    if value is None:
        return None
    return checked_token(value, f"{flag} (or {env_var})")
