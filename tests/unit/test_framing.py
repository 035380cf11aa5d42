"""The sans-IO frame decoder and encoder, with no sockets."""

from __future__ import annotations

import tracemalloc

import pytest

from iop_wire.errors import FrameError
from iop_wire.framing import FrameDecoder, encode_frame


def test_encode_prefixes_big_endian_length() -> None:
    assert bytes(encode_frame(b"abc")) == b"\x00\x00\x00\x03abc"


def test_frames_split_across_feeds_and_packed_in_one() -> None:
    decoder = FrameDecoder()
    stream = encode_frame(b"one") + encode_frame(b"two") + encode_frame(b"three")
    assert decoder.feed(stream[:2]) == []
    assert decoder.feed(stream[2:9]) == [b"one"]
    assert decoder.buffered == 2
    assert decoder.feed(stream[9:]) == [b"two", b"three"]
    assert decoder.buffered == 0


def test_length_zero_is_an_error() -> None:
    with pytest.raises(FrameError, match="frame length 0"):
        FrameDecoder().feed(b"\x00\x00\x00\x00")


def test_oversized_frame_is_refused_from_its_prefix_without_allocating_it() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match=r"4294967295 is outside 1\.\.1024"):
            decoder.feed(b"\xff\xff\xff\xff")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # a 4 GiB announcement allocated nothing near its size
    assert decoder.buffered == 0


def test_frame_at_the_limit_is_accepted_and_one_over_is_not() -> None:
    decoder = FrameDecoder(max_frame_size=8)
    assert decoder.feed(encode_frame(b"12345678", 8)) == [b"12345678"]
    with pytest.raises(FrameError):
        decoder.feed(b"\x00\x00\x00\x09")


def test_encoder_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(FrameError):
        encode_frame(b"")
    with pytest.raises(FrameError):
        encode_frame(b"123456789", max_frame_size=8)
