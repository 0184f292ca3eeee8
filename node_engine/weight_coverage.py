"""Which of the model's weights updates have written since some moment (torch-free): :class:`WeightCoverage`.

A trainer pushes weights in buckets, each a subset of the parameters. Two
questions wait for every parameter to be written: whether weights resumed
without a backup (garbage) are valid again (since they became invalid), and
whether a restarted engine still serves part of its start checkpoint (since
the process started; reported in each update's answer as ``weights_updated_fully``, and whether any was written
as ``weights_updated`` in ``GET /memory_occupation``).
"""

from __future__ import annotations

from typing import Collection, Iterable


class WeightCoverage:
    """The checkpoint keys written since :meth:`restart`; once all were, :attr:`is_full` stays true until then."""

    def __init__(self) -> None:
        self._written: set[str] = set()
        self._full = False

    @property
    def is_full(self) -> bool:
        return self._full

    @property
    def any_written(self) -> bool:
        """Whether any weight was written since :meth:`restart`."""
        return self._full or bool(self._written)

    def restart(self) -> None:
        """Count from now: nothing written yet."""
        self._written.clear()
        self._full = False

    def note_all(self) -> None:
        """A whole checkpoint was written (a reload, or an update naming every key)."""
        self._full = True
        self._written.clear()

    def note(self, keys: Iterable[str], all_keys: Collection[str]) -> None:
        """``keys`` (a bucket) were written; ``all_keys``: every key of the model."""
        if self._full:
            return
        self._written.update(keys)
        if self._written.issuperset(all_keys):
            self.note_all()
