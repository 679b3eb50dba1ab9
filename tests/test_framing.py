"""The front's framing on bytes alone (proxy/inbound/framing.py): heads out, bodies by their length, declines whole."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.inbound.framing import (
    BODY_REFUSED,
    HEAD_TOO_LARGE,
    MAX_HEAD_BYTES,
    NEED_DATA,
    Framer,
    Head,
    Request,
)

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nContent-Length: 5\r\n\r\n"
BODY = b"hello"


def _anything(size: int) -> bool:
    return True


def _noting(admitted: list[int]) -> Callable[[int], bool]:
    """A hook that admits every piece and notes its size."""

    def admit(size: int) -> bool:
        admitted.append(size)
        return True

    return admit


def test_a_request_in_one_read_is_framed_where_it_lies() -> None:
    framer = Framer()
    framer.feed(HEAD + BODY)
    assert framer.next_event() == Head(HEAD)
    admitted: list[int] = []
    framer.take(5, _noting(admitted))
    assert framer.next_event() == Request(bytearray(BODY))
    assert admitted == [5]  # the body in hand, admitted in one piece
    assert framer.next_event() is NEED_DATA and framer.buffered == 0


def test_a_request_split_at_every_byte_is_the_same_request() -> None:
    framer = Framer()
    wire = HEAD + BODY
    events = []
    admitted: list[int] = []
    for i in range(len(wire)):
        framer.feed(wire[i : i + 1])
        while (event := framer.next_event()) is not NEED_DATA:
            events.append(event)
            if isinstance(event, Head):
                framer.take(5, _noting(admitted))
            else:
                break
    assert events == [Head(HEAD), Request(bytearray(BODY))]
    assert admitted == [1] * 5  # each byte of the body admitted as it came


def test_pipelined_requests_come_one_at_a_time() -> None:
    framer = Framer()
    second = HEAD.replace(b"5", b"3") + b"abc"
    framer.feed(HEAD + BODY + second)
    assert framer.next_event() == Head(HEAD)
    framer.take(5, _anything)
    assert framer.next_event() == Request(bytearray(BODY))
    assert framer.buffered == len(second)  # kept for after the first is served
    assert framer.next_event() == Head(HEAD.replace(b"5", b"3"))
    framer.take(3, _anything)
    assert framer.next_event() == Request(bytearray(b"abc"))


def test_a_declined_head_gives_back_every_byte_from_its_first_in_one_piece() -> None:
    framer = Framer()
    framer.feed(HEAD + BODY + b"GET / HTTP/1.1\r\n")
    assert framer.next_event() == Head(HEAD)
    assert framer.decline() == (HEAD + BODY + b"GET / HTTP/1.1\r\n",)


def test_a_body_refused_half_way_gives_back_head_body_and_rest_in_order() -> None:
    framer = Framer()
    framer.feed(HEAD + b"he")
    assert framer.next_event() == Head(HEAD)
    budget = [2]  # room for the first piece only

    def admit(size: int) -> bool:
        if size > budget[0]:
            return False
        budget[0] -= size
        return True

    framer.take(5, admit)
    assert framer.next_event() is NEED_DATA
    framer.feed(b"llo" + b"NEXT")
    assert framer.next_event() is BODY_REFUSED
    assert b"".join(framer.decline()) == HEAD + BODY + b"NEXT"


def test_a_head_past_the_limit_is_too_large_and_given_back() -> None:
    framer = Framer()
    framer.feed(b"POST / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES)
    assert framer.next_event() is HEAD_TOO_LARGE
    assert b"".join(framer.decline()) == b"POST / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES


def test_an_empty_body_is_a_request_at_once() -> None:
    framer = Framer()
    framer.feed(HEAD.replace(b"5", b"0"))
    assert isinstance(framer.next_event(), Head)
    framer.take(0, _anything)
    assert framer.next_event() == Request(bytearray())


def test_a_head_must_be_taken_or_declined_before_the_next_event() -> None:
    framer = Framer()
    framer.feed(HEAD)
    framer.next_event()
    with pytest.raises(RuntimeError):
        framer.next_event()
