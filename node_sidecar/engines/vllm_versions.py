"""The weight version a vLLM node serves, and which version each answer's tokens were made under (SGLang 0.5.23's
``meta_info.weight_versions``: ``{"version", "start", "end"}`` spans of output tokens, ``weight_version`` the last
span's).

vLLM's completions say nothing of versions, so the sidecar tracks them: every version change goes through it
(:meth:`ServedVersions.rename`), and an answer's :class:`VersionTrail` starts from the version served when the
request was translated. On a vLLM node the weights cannot change under a running request (every update drains or
aborts generation first; pauses that keep requests are refused), so only a rename by ``/update_weight_version``
can fall inside one:

- with ``abort_all_requests`` (SGLang's default) the request was aborted before the rename: every token it has is
  the old version's, as SGLang answers an abort before it takes the version;
- without, tokens the sidecar had already relayed when it saw the rename are the old version's, the rest the new
  one's. A whole (non-stream) answer is seen only at its end: all its tokens are the new version's (the weights
  that made them are the ones that name now labels).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

from handoff.protocol.generation import weight_version_spans

MAX_RENAMES = 1024  # renames remembered; an answer that outlives more (one per training step) sees the newest


@dataclass(frozen=True)
class Rename:
    seq: int
    version: str | None
    aborted_at: int | None  # the seq of the abort of every request that preceded it, if it aborted them


class ServedVersions:
    """The version served now, and the renames (each numbered) an answer under way may have to account for."""

    def __init__(self, version: str | None = None) -> None:
        self.current = version
        self.seq = 0
        self._renames: deque[Rename] = deque(maxlen=MAX_RENAMES)

    def abort_all(self) -> int:
        """Every running request is being aborted (before a rename); its number, for :meth:`rename`."""
        self.seq += 1
        return self.seq

    def rename(self, version: str | None, *, aborted_at: int | None = None) -> None:
        if version == self.current:
            return
        self.seq += 1
        self._renames.append(Rename(self.seq, version, aborted_at))
        self.current = version

    def since(self, seq: int) -> list[Rename]:
        """The renames after ``seq``, oldest first; walks only those (it runs for every piece of every stream)."""
        newer = list(takewhile(lambda rename: rename.seq > seq, reversed(self._renames)))
        newer.reverse()
        return newer

    def trail(self) -> VersionTrail:
        return VersionTrail(self.current, self.seq, self.seq)


@dataclass
class VersionTrail:
    """One answer's versions so far: ``version`` made its latest tokens; ``events`` (old version, tokens made
    before the change) as SGLang records them."""

    version: str | None
    started: int
    seen: int
    ended: bool = False  # aborted before a rename: later renames are not its
    events: list[tuple[str, int]] = field(default_factory=list)

    def follow(self, versions: ServedVersions, tokens_relayed: int) -> None:
        """The renames since last seen, with ``tokens_relayed`` tokens of this answer relayed before them."""
        if self.seen == versions.seq:
            return  # nothing since (every piece of a stream asks)
        for rename in versions.since(self.seen):
            if self.ended:
                break
            if rename.aborted_at is not None and rename.aborted_at > self.started:
                self.ended = True
                break
            if tokens_relayed > 0 and self.version is not None:
                self.events.append((self.version, tokens_relayed))
            self.version = rename.version
        self.seen = versions.seq

    def spans(self, num_output_tokens: int) -> list[dict[str, Any]] | None:
        """SGLang's ``weight_versions`` for a final answer of ``num_output_tokens``; None while no version is known."""
        if self.version is None:
            return None
        events = [(version, end) for version, end in self.events if min(end, num_output_tokens) > 0]
        return weight_version_spans(events, self.version, num_output_tokens)
