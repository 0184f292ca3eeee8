"""``WholeAnswer`` past its deadline: a client still reading gets the whole answer; one that stopped is cut.

Driven as ASGI with a ``send`` that stands for the connection: each body piece waits while "the client" does not
read (a real socket's drain), so the timing of the cut is the class's own, not a server's.
"""

from __future__ import annotations

import asyncio

import pytest

from handoff.service.relay import ANSWER_PIECE_BYTES, STALLED_CLIENT_GRACE_S, WholeAnswer

pytestmark = pytest.mark.timeout(30)

NUM_PIECES = 12


class Connection:
    """The pieces sent so far; each body piece takes ``per_piece_s`` to be read (None: the client never reads
    past the first piece)."""

    def __init__(self, per_piece_s: float | None) -> None:
        self.per_piece_s = per_piece_s
        self.pieces: list[bytes] = []

    async def send(self, message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        if self.pieces and self.per_piece_s is None:
            await asyncio.Event().wait()  # never read
        self.pieces.append(message["body"])
        if self.per_piece_s is not None:
            await asyncio.sleep(self.per_piece_s)  # the client reading at its pace


async def serve(answer: WholeAnswer, connection: Connection) -> None:
    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}
    await answer({"type": "http"}, receive, connection.send)


def answer_past_its_deadline(closes: list[int]) -> WholeAnswer:
    body = bytes(NUM_PIECES * ANSWER_PIECE_BYTES)
    deadline = asyncio.get_running_loop().time() - 2 * STALLED_CLIENT_GRACE_S  # read just before it, say
    return WholeAnswer(body, status=200, headers=[(b"content-length", str(len(body)).encode())],
                       on_close=lambda: closes.append(1), deadline=deadline)


async def test_a_client_reading_slowly_past_the_deadline_gets_the_whole_answer() -> None:
    """Found by review: past its deadline (and a second's grace) the answer was cut whenever a send was waiting,
    and with a large answer one nearly always is, however steadily the client reads: an answer read from the
    peer just before its deadline was cut while going out."""
    closes: list[int] = []
    connection = Connection(per_piece_s=0.2)  # 2.4 s in all, each piece taken well within the grace
    await asyncio.wait_for(serve(answer_past_its_deadline(closes), connection), 20)
    assert len(connection.pieces) == NUM_PIECES and closes == [1]


async def test_a_client_that_stopped_reading_past_the_deadline_is_cut() -> None:
    closes: list[int] = []
    connection = Connection(per_piece_s=None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(serve(answer_past_its_deadline(closes), connection), 20)
    assert len(connection.pieces) == 1 and closes == [1]
    assert loop.time() - started < 10 * STALLED_CLIENT_GRACE_S  # cut within a grace or two, never left waiting
