"""The services' HTTP protocol (handoff/service/http_protocol.py): one write per answer, disconnects noticed."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from handoff.service.disconnect import NOTICE_EXTENSION, DisconnectNotice, DisconnectWatch
from handoff.service.http_protocol import _HeadWithBody
from tests.support.procs import ServerProcess


class RecordingTransport(asyncio.Transport):
    """What the real transport was asked to write, write by write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_a_head_and_its_body_are_one_write_and_later_writes_pass_through() -> None:
    transport = RecordingTransport()
    cycle = _HeadWithBody(transport, asyncio.get_running_loop())
    cycle.write(b"HTTP/1.1 200 OK\r\n\r\n")
    cycle.write(b"body")
    cycle.write(b"more")
    await asyncio.sleep(0)  # the end of the turn: nothing held is left to flush
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]


async def test_a_head_alone_goes_out_at_the_end_of_the_turn() -> None:
    """A stream whose first chunk is not in yet: its client gets the head now, not with the first chunk."""
    transport = RecordingTransport()
    cycle = _HeadWithBody(transport, asyncio.get_running_loop())
    cycle.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\n"]
    cycle.write(b"data: 1\n\n")
    assert transport.writes[-1] == b"data: 1\n\n"


async def test_close_sends_what_is_held_first_and_a_gone_client_gets_nothing() -> None:
    loop = asyncio.get_running_loop()
    closing = RecordingTransport()
    cycle = _HeadWithBody(closing, loop)
    cycle.write(b"head")
    cycle.close()
    assert closing.writes == [b"head"] and closing.closed
    gone = RecordingTransport()
    cycle = _HeadWithBody(gone, loop)
    cycle.write(b"head")
    gone.closed = True  # the client left before the end of the turn
    await asyncio.sleep(0)
    assert gone.writes == []


def test_pipelined_answers_of_a_real_service_stay_whole_and_in_order(proc_log_dir: Path) -> None:
    """Through a real service (the engine, served by ``handoff.service.serve``): three requests pipelined on
    one connection get three answers, in order, each head with its own body."""
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=proc_log_dir,
                           name="engine-one-write").start(timeout=120)
    try:
        with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 3)
            received = b""
            while received.count(b'{"status":"ok"}') < 3:
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
        answers = received.split(b"HTTP/1.1 ")[1:]
        assert len(answers) == 3, received
        assert all(a.startswith(b"200 OK\r\n") and a.endswith(b'\r\n\r\n{"status":"ok"}') for a in answers), received
    finally:
        engine.stop()


async def never() -> dict:
    await asyncio.Event().wait()
    return {}


async def serving(watch_of) -> tuple[bool, bool]:
    """A task serving a request under a DisconnectWatch: (whether it was cancelled by it, whether the watch
    says the client left)."""
    watch = watch_of()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        return watch.is_disconnected, True
    finally:
        watch.stop()
    return False, False


async def test_the_servers_notice_cancels_the_request_without_a_task_per_request() -> None:
    notice = DisconnectNotice()
    scope = {"type": "http", "extensions": {NOTICE_EXTENSION: notice}}
    tasks_before = len(asyncio.all_tasks())
    task = asyncio.ensure_future(serving(lambda: DisconnectWatch(never, scope)))
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == tasks_before + 1  # the request's own task, no watcher beside it
    notice.lost()
    assert await asyncio.wait_for(task, 5) == (True, True)
    # a watch started after the connection was lost cancels its request at once
    late = asyncio.ensure_future(serving(lambda: DisconnectWatch(never, scope)))
    assert await asyncio.wait_for(late, 5) == (True, True)


async def test_a_stopped_watch_is_not_called_and_a_finished_one_cancels_nothing() -> None:
    notice = DisconnectNotice()
    scope = {"type": "http", "extensions": {NOTICE_EXTENSION: notice}}
    stopped = DisconnectWatch(never, scope)
    stopped.stop()
    finished = DisconnectWatch(never, scope)
    finished.finish()
    notice.lost()  # neither cancels this test's task
    await asyncio.sleep(0)
    assert not stopped.is_disconnected and not finished.is_disconnected
    finished.stop()


async def test_without_the_notice_a_watcher_waits_on_receive() -> None:
    """Another ASGI server (or an in-process transport): the watch consumes ``receive`` as before."""
    left = asyncio.Event()

    async def receive() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(serving(lambda: DisconnectWatch(receive, {"type": "http"})))
    await asyncio.sleep(0)
    left.set()
    assert await asyncio.wait_for(task, 5) == (True, True)


async def test_watching_asks_the_server_to_read_again() -> None:
    """uvicorn stops reading while a body waits for the app; a client leaving is only seen while reading, so a
    watch started on the server's notice asks it to read again (``on_watch``), once per watch."""
    resumed = []
    notice = DisconnectNotice(on_watch=lambda: resumed.append(True))
    watch = DisconnectWatch(never, {"type": "http", "extensions": {NOTICE_EXTENSION: notice}})
    assert resumed == [True]
    watch.stop()
