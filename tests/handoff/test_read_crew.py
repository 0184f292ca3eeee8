"""The read crew that fills a checkpoint read's pinned buffer on several threads (``handoff.checkpoint.read_crew``)."""

from __future__ import annotations

import os
import threading

import pytest

from handoff.checkpoint.read_crew import MIN_SLICE_BYTES, ReadCrew

MB = 1024 * 1024


def test_slices_cover_the_fill_once_and_small_fills_stay_on_one_thread():
    crew = ReadCrew(4)
    for num_bytes in (0, 1, MIN_SLICE_BYTES - 1, MIN_SLICE_BYTES, 3 * MIN_SLICE_BYTES + 5, 64 * MB, 64 * MB + 3):
        bounds = crew.slices(num_bytes)
        covered = [i for start, end in bounds for i in (start, end)]
        assert covered[:1] in ([], [0]) and (not bounds or bounds[-1][1] == num_bytes), num_bytes
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1)), num_bytes
        assert len(bounds) <= 4 and all(end > start for start, end in bounds), num_bytes
    assert len(crew.slices(MIN_SLICE_BYTES * 2 - 1)) == 1
    assert len(crew.slices(64 * MB)) == 4


def test_a_fill_reads_every_slice_of_a_file_on_several_threads(tmp_path):
    data = os.urandom(24 * MB + 17)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    buffer = bytearray(len(data))
    view = memoryview(buffer)
    readers: set[str] = set()
    all_reading = threading.Barrier(4, timeout=10)  # passes only if four slices are read at the same time
    fd = os.open(path, os.O_RDONLY)
    try:
        def read_slice(start: int, end: int) -> None:
            readers.add(threading.current_thread().name)
            all_reading.wait()
            assert os.preadv(fd, [view[start:end]], start) == end - start

        with ReadCrew(4) as crew:
            crew.fill(len(data), read_slice)
    finally:
        os.close(fd)
    assert bytes(buffer) == data
    assert readers == {"checkpoint-read", threading.current_thread().name}


def test_a_failed_slice_is_raised_after_every_slice_has_ended():
    ended: list[int] = []
    lock = threading.Lock()
    released = threading.Event()

    def read_slice(start: int, end: int) -> None:
        if start == 0:
            raise OSError("the first slice fails at once")
        released.wait(timeout=10)  # the others are still writing when the first has failed
        with lock:
            ended.append(start)

    with ReadCrew(3) as crew:
        threading.Timer(0.2, released.set).start()
        with pytest.raises(OSError, match="first slice"):
            crew.fill(3 * MIN_SLICE_BYTES, read_slice)
        assert sorted(ended) == [MIN_SLICE_BYTES, 2 * MIN_SLICE_BYTES]  # nothing writes the buffer after the raise


def test_the_crew_threads_end_with_its_block():
    before = set(threading.enumerate())
    with ReadCrew(3) as crew:
        threads = [t for t in threading.enumerate() if t not in before and t.name == "checkpoint-read"]
        assert len(threads) == 2 and all(t.daemon for t in threads)
        crew.fill(8 * MIN_SLICE_BYTES, lambda start, end: None)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    with pytest.raises(ValueError):
        ReadCrew(0)
