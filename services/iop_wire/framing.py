"""Sans-IO framing: a frame is a 4-byte big-endian uint32 length, then that many bytes.

No sockets and no logging here: :class:`FrameDecoder` is fed bytes and returns whole frame
bodies; :func:`encode_frame` builds one frame in a single allocation.
"""

from __future__ import annotations

import struct

from iop_wire.errors import FrameError

__all__ = ["DEFAULT_MAX_FRAME_SIZE", "HEADER_SIZE", "PREFACE_PREFIX", "FrameDecoder", "encode_frame", "preface"]

HEADER_SIZE = 4
DEFAULT_MAX_FRAME_SIZE = 4 * 1024 * 1024
_HEADER = struct.Struct(">I")
PREFACE_PREFIX = b"IOP/1 "
"""A connection's first frame (each way) is this and a codec name: see :mod:`iop_wire.endpoint`."""


def encode_frame(body: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytearray:
    """Return ``body`` with its length prefix (one allocation), refusing what the peer would."""
    size = len(body)
    if size == 0 or size > max_frame_size:
        raise FrameError(f"frame body of {size} bytes is outside 1..{max_frame_size}")
    frame = bytearray(HEADER_SIZE + size)
    _HEADER.pack_into(frame, 0, size)
    frame[HEADER_SIZE:] = body
    return frame


def preface(codec: str) -> bytes:
    """The preface frame asking for (or accepting) ``codec``."""
    return bytes(encode_frame(PREFACE_PREFIX + codec.encode()))


class FrameDecoder:
    """Splits a byte stream into frame bodies.

    The length prefix is checked before a byte of the body is buffered, so an oversized or
    empty frame raises :class:`FrameError` without allocating it. After an error the stream
    cannot be resynchronised; the caller closes the connection.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame (non-zero at EOF means a cut frame)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data`` and return every frame body it completes, in order."""
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        offset = 0
        available = len(buffer)
        while available - offset >= HEADER_SIZE:
            (size,) = _HEADER.unpack_from(buffer, offset)
            if size == 0 or size > self.max_frame_size:
                del buffer[:]
                raise FrameError(f"frame length {size} is outside 1..{self.max_frame_size} bytes")
            end = offset + HEADER_SIZE + size
            if end > available:
                break
            frames.append(bytes(buffer[offset + HEADER_SIZE : end]))
            offset = end
        if offset:
            del buffer[:offset]
        return frames
