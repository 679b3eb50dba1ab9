"""The front's framing on bytes alone (proxy/inbound/framing.py): heads out, bodies by their length, declines whole."""

from __future__ import annotations

import pytest

from proxy.inbound.framing import MAX_HEAD_BYTES, NEED_DATA, Framer, Head, HeadTooLarge, Piece, Request

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nContent-Length: 5\r\n\r\n"
BODY = b"hello"


def _request(framer: Framer, length: int) -> Request:
    """Take the head just out; keep every piece until the request is whole."""
    framer.take(length)
    while True:
        event = framer.next_event()
        if isinstance(event, Request):
            return event
        assert isinstance(event, Piece), event
        framer.keep(event)


def test_a_request_in_one_read_is_framed_where_it_lies() -> None:
    framer = Framer()
    framer.feed(HEAD + BODY)
    assert framer.next_event() == Head(HEAD)
    framer.take(5)
    piece = framer.next_event()
    assert isinstance(piece, Piece) and isinstance(piece.data, memoryview)  # a view: no copy yet
    assert bytes(piece.data) == BODY
    framer.keep(piece)
    assert framer.next_event() == Request(bytearray(BODY))
    assert framer.next_event() is NEED_DATA and framer.buffered == 0


def test_a_request_split_at_every_byte_is_the_same_request() -> None:
    framer = Framer()
    wire = HEAD + BODY
    events = []
    for i in range(len(wire)):
        framer.feed(wire[i : i + 1])
        while (event := framer.next_event()) is not NEED_DATA:
            events.append(event)
            if isinstance(event, Head):
                framer.take(5)
            elif isinstance(event, Piece):
                framer.keep(event)
            else:
                break
    heads = [e for e in events if isinstance(e, Head)]
    assert heads == [Head(HEAD)] and events[-1] == Request(bytearray(BODY))


def test_pipelined_requests_come_one_at_a_time() -> None:
    framer = Framer()
    second = HEAD.replace(b"5", b"3") + b"abc"
    framer.feed(HEAD + BODY + second)
    assert framer.next_event() == Head(HEAD)
    assert _request(framer, 5) == Request(bytearray(BODY))
    assert framer.buffered == len(second)  # kept for after the first is served
    assert framer.next_event() == Head(HEAD.replace(b"5", b"3"))
    assert _request(framer, 3) == Request(bytearray(b"abc"))


def test_a_declined_head_gives_back_every_byte_from_its_first_in_one_piece() -> None:
    framer = Framer()
    framer.feed(HEAD + BODY + b"GET / HTTP/1.1\r\n")
    assert framer.next_event() == Head(HEAD)
    assert framer.decline() == (HEAD + BODY + b"GET / HTTP/1.1\r\n",)


def test_a_body_declined_half_way_gives_back_head_body_and_rest_in_order() -> None:
    framer = Framer()
    framer.feed(HEAD + b"he")
    assert framer.next_event() == Head(HEAD)
    framer.take(5)
    piece = framer.next_event()
    assert isinstance(piece, Piece)
    framer.keep(piece)
    framer.feed(b"llo" + b"NEXT")
    assert isinstance(framer.next_event(), Piece)  # not kept: the budget said no
    assert b"".join(framer.decline()) == HEAD + BODY + b"NEXT"


def test_a_head_past_the_limit_is_too_large_and_given_back() -> None:
    framer = Framer()
    framer.feed(b"POST / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES)
    assert isinstance(framer.next_event(), HeadTooLarge)
    assert b"".join(framer.decline()) == b"POST / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES


def test_an_empty_body_is_a_request_at_once() -> None:
    framer = Framer()
    framer.feed(HEAD.replace(b"5", b"0"))
    assert isinstance(framer.next_event(), Head)
    assert _request(framer, 0) == Request(bytearray())


def test_a_head_must_be_taken_or_declined_before_the_next_event() -> None:
    framer = Framer()
    framer.feed(HEAD)
    framer.next_event()
    with pytest.raises(RuntimeError):
        framer.next_event()
