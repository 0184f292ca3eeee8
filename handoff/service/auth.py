"""Bearer-token checks for SPEC section 6: constant-time compare, never logged."""

from __future__ import annotations

import hmac
import os

from starlette.requests import Request

from handoff.service.errors import Unauthorized


class BearerToken:
    """One configured token; ``None`` means the endpoints it guards are open.

    ``repr`` never shows the secret, so logging the object is safe.
    """

    __slots__ = ("_expected",)

    def __init__(self, token: str | None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    @property
    def is_enabled(self) -> bool:
        return self._expected is not None

    def check(self, request: Request) -> None:
        """Raise :class:`Unauthorized` unless the request carries the token."""
        if self._expected is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, self._expected):
            raise Unauthorized()

    def header(self) -> dict[str, str]:
        """The Authorization header to send to a peer that expects this token."""
        if self._expected is None:
            return {}
        return {"Authorization": self._expected.decode()}

    def __repr__(self) -> str:
        return f"BearerToken(enabled={self.is_enabled})"


def token_from(flag_value: str | None, env_var: str) -> str | None:
    """A flag wins over its environment variable; empty strings mean unset."""
    return flag_value or os.environ.get(env_var) or None
