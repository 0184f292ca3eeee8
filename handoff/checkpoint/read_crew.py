"""Reading one buffer's slices on several threads at once.

One thread reading from the page cache copies at a few GB/s; a checkpoint read
onto a GPU waits on that copy. :class:`ReadCrew` splits a fill into slices
and runs them on a few daemon threads (``os.preadv`` releases the GIL, so the
copies run in parallel), the caller's thread taking one slice itself.

Rules:

- A fill returns only when every slice has ended, so the buffer is never
  written after :meth:`ReadCrew.fill` returns (it is reused for the next one).
  The first slice's error is raised after all of them end.
- The threads are daemons, owned by one ``with`` block: a slice blocked on a
  hung mount holds only its thread, and the process can still exit. The
  caller runs the whole read on a bounded thread (:mod:`handoff.bounded_thread`)
  whose deadline covers the crew.
- Small fills are read on the caller's thread alone (``MIN_SLICE_BYTES``).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

MIN_SLICE_BYTES = 1024 * 1024  # below this, a thread's hand-off costs more than the copy saves

ReadSlice = Callable[[int, int], None]  # reads bytes [start, end) of the buffer being filled


class ReadCrew:
    """``num_threads`` readers (the caller's thread included) that fill one buffer's slices in parallel."""

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"a read crew needs at least one thread, not {num_threads}")
        self.num_threads = num_threads
        self._jobs: queue.SimpleQueue[tuple[ReadSlice, int, int, queue.SimpleQueue] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name="checkpoint-read", daemon=True)
                         for _ in range(num_threads - 1)]

    def __enter__(self) -> ReadCrew:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def fill(self, num_bytes: int, read_slice: ReadSlice) -> None:
        """Read ``num_bytes`` as slices ``read_slice(start, end)``, in parallel when they are large enough."""
        bounds = self.slices(num_bytes)
        ended: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        for start, end in bounds[1:]:
            self._jobs.put((read_slice, start, end, ended))
        errors = [_run(read_slice, *bounds[0])] if bounds else []
        errors += [ended.get() for _ in bounds[1:]]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first

    def slices(self, num_bytes: int) -> list[tuple[int, int]]:
        """``[start, end)`` bounds covering ``num_bytes``: one per thread, none under ``MIN_SLICE_BYTES``."""
        count = max(1, min(self.num_threads, num_bytes // MIN_SLICE_BYTES))
        step = -(-num_bytes // count)
        return [(start, min(start + step, num_bytes)) for start in range(0, num_bytes, step)] if num_bytes else []

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            read_slice, start, end, ended = job
            ended.put(_run(read_slice, start, end))


def _run(read_slice: ReadSlice, start: int, end: int) -> BaseException | None:
    try:
        read_slice(start, end)
    except BaseException as exc:  # handed to the filling thread, which raises the first
        return exc
    return None
