"""A ``multipart/form-data`` upload read as it arrives: sans-IO, so a file is never held whole.

:class:`UploadForm` wraps python-multipart's streaming parser: ``feed(bytes)`` takes the body in
pieces of any size and returns what they completed, in order: :class:`Field` (a text field,
whole), :class:`FileStart` (the file part's headers), :class:`FileBytes` (the file's next bytes,
never more than ``chunk_size``), :class:`FileEnd`. File bytes are gathered until more than
``chunk_size`` wait, so every piece but the last is exactly ``chunk_size`` bytes and the last
(given with :class:`FileEnd`) is never empty unless the file is. The form holds at most
``chunk_size`` bytes of the file plus the piece being fed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from python_multipart.exceptions import FormParserError, MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from iop_wire.openai.errors import ApiError

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

__all__ = ["CHUNK_SIZE", "Field", "FileBytes", "FileEnd", "FileStart", "FormEvent", "UploadForm"]

CHUNK_SIZE = 256 * 1024
"""Bytes per file.chunk sent to the worker (runtime.proto: the edge sends 256 KiB)."""
_MAX_FIELD_BYTES = 64 * 1024
"""Largest text field; the file part is the only large one."""


@dataclass(frozen=True, slots=True)
class Field:
    """A text field of the form."""

    name: str
    value: str


@dataclass(frozen=True, slots=True)
class FileStart:
    """The file part begins."""

    name: str
    """The form field (``file``)."""
    filename: str


@dataclass(frozen=True, slots=True)
class FileBytes:
    """The file's next bytes: exactly ``chunk_size`` of them."""

    data: bytes


@dataclass(frozen=True, slots=True)
class FileEnd:
    """The file part ended; ``data`` is its last bytes (at most ``chunk_size``)."""

    data: bytes
    size: int
    """The file's size in bytes."""


FormEvent = Field | FileStart | FileBytes | FileEnd


class UploadForm:
    """One multipart body, fed in pieces; parts with a filename are files, the rest text fields."""

    def __init__(self, content_type: str, *, chunk_size: int = CHUNK_SIZE) -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            message = "the request must be multipart/form-data (with a boundary), the way OpenAI's SDK sends files"
            raise ApiError(400, message)
        self.chunk_size = chunk_size
        self.ended = False
        """The closing boundary was read."""
        self._events: list[FormEvent] = []
        self._headers: dict[bytes, bytes] = {}
        self._header = bytearray()
        self._value = bytearray()
        self._part: FileStart | Field | None = None
        self._data = bytearray()
        self._size = 0
        self._parser = _parser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
        )

    def feed(self, piece: bytes) -> list[FormEvent]:
        """The events ``piece`` completes; 400 on a malformed body."""
        try:
            self._parser.write(piece)
        except MultipartParseError as exc:
            raise ApiError(400, f"the multipart/form-data body is malformed: {exc}") from None
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """The body ended: 400 unless the form was complete."""
        if not self.ended:
            raise ApiError(400, "the multipart/form-data body ended before its closing boundary")

    # -- parser callbacks ----------------------------------------------------------------------

    def _part_begin(self) -> None:
        self._headers.clear()
        self._part = None
        self._value.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[bytes(self._header).lower()] = bytes(self._value)
        self._header.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        if filename is None:
            self._part = Field(name, "")
            return
        self._part = FileStart(name, filename.decode("utf-8", "replace"))
        self._size = 0
        self._events.append(self._part)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if isinstance(self._part, FileStart):
            self._data += data[start:end]
            self._size += end - start
            while len(self._data) > self.chunk_size:  # keep the rest for the next piece or the end
                self._events.append(FileBytes(bytes(self._data[: self.chunk_size])))
                del self._data[: self.chunk_size]
        else:
            self._value += data[start:end]
            if len(self._value) > _MAX_FIELD_BYTES:
                raise ApiError(400, f"a form field is over {_MAX_FIELD_BYTES} bytes; only the file may be larger")

    def _part_end(self) -> None:
        part = self._part
        if isinstance(part, FileStart):
            self._events.append(FileEnd(bytes(self._data), self._size))
            self._data.clear()
        elif isinstance(part, Field):
            self._events.append(Field(part.name, self._value.decode("utf-8", "replace")))
        self._part = None
        self._value.clear()

    def _end(self) -> None:
        self.ended = True


def _parser(boundary: bytes, callbacks: MultipartCallbacks) -> MultipartParser:
    """The body's parser; 400 for a boundary it refuses (over 256 characters: RFC 2046 allows 70)."""
    try:
        return MultipartParser(boundary, callbacks)
    except FormParserError as exc:
        raise ApiError(400, f"the multipart/form-data boundary cannot be used: {exc}") from None
