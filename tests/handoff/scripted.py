"""Helpers for tests against the scripted server (``tests/support/scripted_app.py``; the ``server`` fixture)."""

from __future__ import annotations

import httpx

from tests.support.procs import ServerProcess

UNAVAILABLE = {"status": 503, "headers": {"Retry-After": "1"},
               "body": {"error": {"type": "no_available_node", "message": "all released"}}}


def script(server: ServerProcess, *answers: dict) -> None:
    """Queue the answers of the next requests."""
    httpx.post(server.url + "/_script", json=list(answers)).raise_for_status()


def received(server: ServerProcess) -> list[dict]:
    return httpx.get(server.url + "/_requests").json()
