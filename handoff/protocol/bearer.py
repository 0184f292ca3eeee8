"""What a bearer token may be, for the services that check one and the clients that send one."""

from __future__ import annotations

__all__ = ["checked_token"]


def checked_token(value: str, what: str) -> str:
    """``value`` without the whitespace around it (a token read from a file keeps its newline); raises
    ``ValueError`` naming ``what``, never the value, when it is blank or holds anything but visible ASCII (an
    ``Authorization`` header could not carry it)."""
    token = value.strip()
    if not token:
        raise ValueError(f"{what} is blank: give a token, or leave it unset")
    if not all(0x21 <= ord(char) <= 0x7E for char in token):
        raise ValueError(f"{what} must be visible ASCII characters without spaces")
    return token
