"""Generation clients in background threads, recording exactly how each request ended."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from handoff.protocol.generation import finish_type
from tests.support.sse import DONE, iter_events


@dataclass
class ClientResult:
    status: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    body: Any = None
    saw_done: bool = False
    error: str | None = None
    retry_after: str | None = None
    ended_at: float | None = None  # time.monotonic() when the request ended (for a failure's account)

    def summary(self, since: float) -> str:
        """One line on how the request ended, ``since`` a moment of the test (a time.monotonic() value)."""
        when = "still running" if self.ended_at is None else f"ended {self.ended_at - since:+.2f} s"
        return (f"{when}: status {self.status}, finish {self.finish_reason}, {self.num_tokens} tokens, "
                f"error {self.error}")

    @property
    def finish_reason(self) -> str | None:
        """How it ended, from an SGLang answer (``meta_info.finish_reason``'s type) or an OpenAI one
        (``choices[0].finish_reason``): ``stop``, ``length``, ``abort``; None while it has not."""
        answers = [self.body] if isinstance(self.body, dict) else list(reversed(self.events))
        for answer in answers:
            reason = answer.get("meta_info", {}).get("finish_reason")
            if reason:
                return finish_type(reason)
            choices = answer.get("choices") or [{}]
            if choices[0].get("finish_reason"):
                return choices[0]["finish_reason"]
        return None

    @property
    def num_tokens(self) -> int:
        """Tokens of the answer: SGLang's ``output_ids`` (a stream's events each carry the whole answer so far),
        OpenAI's ``usage.completion_tokens``, or one per OpenAI stream event with a choice."""
        if isinstance(self.body, dict):
            usage = self.body.get("usage") or {}
            return len(self.body.get("output_ids", [])) or usage.get("completion_tokens", 0)
        if self.events and "output_ids" in self.events[-1]:
            return len(self.events[-1]["output_ids"])
        return sum(1 for event in self.events if event.get("choices"))


class GenerationClient(threading.Thread):
    """One request (stream or not) to ``url``; ``result`` tells how it ended."""

    def __init__(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = body
        self.headers = headers or {}
        self.timeout = timeout
        self.result = ClientResult()
        self.started_streaming = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout) as client:
                if self.body.get("stream"):
                    self._stream(client)
                else:
                    r = client.post(self.url, json=self.body, headers=self.headers)
                    self.result.status = r.status_code
                    self.result.retry_after = r.headers.get("retry-after")
                    self.result.body = r.json()
        except httpx.HTTPError as exc:
            self.result.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.result.ended_at = time.monotonic()
            self.started_streaming.set()

    def _stream(self, client: httpx.Client) -> None:
        with client.stream("POST", self.url, json=self.body, headers=self.headers) as r:
            self.result.status = r.status_code
            self.result.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                r.read()
                self.result.body = r.json()
                return
            for data in iter_events(r):
                self.started_streaming.set()
                if data == DONE:
                    self.result.saw_done = True
                else:
                    self.result.events.append(json.loads(data))

    def finish(self, timeout: float = 60.0) -> ClientResult:
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"request to {self.url} still running after {timeout}s")
        return self.result


class SteadyLoad(threading.Thread):
    """Requests to ``url`` back to back (each sent as the one before ended) until :meth:`finish`; ``results``
    tells how each ended."""

    def __init__(self, url: str, body: dict[str, Any], *, timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.timeout = url, body, timeout
        self.results: list[ClientResult] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            request = GenerationClient(self.url, self.body, timeout=self.timeout)
            request.run()  # in this thread
            self.results.append(request.result)

    def finish(self, timeout: float = 60.0) -> list[ClientResult]:
        self._stopping.set()
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"requests to {self.url} still running after {timeout}s")
        return self.results


def start_clients(url: str, body: dict[str, Any], num: int, **kwargs: Any) -> list[GenerationClient]:
    clients = [GenerationClient(url, body, **kwargs) for _ in range(num)]
    for c in clients:
        c.start()
    return clients
