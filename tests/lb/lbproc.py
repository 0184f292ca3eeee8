"""The LB as a real process in tests: a blocking client for it and ways to set its members."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.procs import ServerProcess, wait_until

# fast health checks so state changes show within a fraction of a second
FAST_HEALTH = ["--health-interval", "0.2", "--health-timeout", "1"]


class LB:
    """A running LB process and a blocking client for it."""

    def __init__(self, proc: ServerProcess) -> None:
        self.proc = proc
        self.url = proc.url
        self.http = httpx.Client(base_url=proc.url, timeout=30.0)

    def nodes(self) -> list[dict[str, Any]]:
        return self.http.get("/nodes").json()["nodes"]

    def node(self, url: str) -> dict[str, Any]:
        return next(n for n in self.nodes() if n["url"] == url)

    def wait_routable(self, urls: list[str], expected: bool = True, timeout: float = 10.0) -> None:
        wait_until(lambda: all(self.node(u)["routable"] is expected for u in urls), timeout=timeout,
                   what=f"{urls} routable={expected}")

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")

    def close(self) -> None:
        self.http.close()
        self.proc.stop()


def node_args(*urls: str, flag: str = "--node") -> list[str]:
    return [arg for url in urls for arg in (flag, url)]


def set_members(lb: LB, *members: str | tuple[str, str] | tuple[str, str, int]) -> None:
    """Make the LB's members exactly ``members`` through its admin API.

    Each member is a URL (mixed), (URL, role) or (URL, "prefill", bootstrap port).
    """
    for node in lb.nodes():
        lb.http.delete("/nodes", params={"url": node["url"]}).raise_for_status()
    for member in members:
        url, role, *bootstrap = member if isinstance(member, tuple) else (member, "mixed")
        body = {"url": url, "role": role, "bootstrap_port": bootstrap[0] if bootstrap else None}
        lb.http.post("/nodes", json=body).raise_for_status()
