"""A run's events as OpenAI's Responses API answers them: the ``Response`` object, and the
Responses event stream (:class:`ResponseEvents`, an ``app.Chunks`` of the edge).

Shapes follow OpenAI's ``Response``, ``ResponseUsage`` and the ``ResponseStreamEvent`` members;
the end-to-end tests validate every body and event against the official OpenAPI document.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai.errors import ApiError
from iop_wire.openai.responses import Outcome, json_bytes
from iop_wire.openai.responses_api import ResponsesRequest, new_id, text_part

__all__ = ["ResponseEvents", "failed", "finished", "response_body", "skeleton", "usage_body"]


def usage_body(usage: pb.Usage) -> dict[str, Any]:
    """OpenAI's ResponseUsage."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def skeleton(response_id: str, model: str, parsed: ResponsesRequest) -> dict[str, Any]:
    """The Response while in progress: no output yet, the request's fields echoed."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        **parsed.echo,
    }


def response_body(base: Mapping[str, Any], outcome: Outcome, complete: pb.RunComplete) -> dict[str, Any]:
    """The whole Response of a run that completed (``base`` from :func:`skeleton`)."""
    output: list[dict[str, Any]] = []
    text = "".join(outcome.text)
    if text or not outcome.tool_calls:
        output.append(_message_output(new_id("msg"), text, "completed"))
    output.extend(
        _call_output(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in outcome.calls()
    )
    return finished(base, output, complete)


def finished(base: Mapping[str, Any], output: list[dict[str, Any]], complete: pb.RunComplete) -> dict[str, Any]:
    """``base`` completed (or incomplete at the token limit) with ``output`` and the run's usage."""
    body = {**base, "output": output, "usage": usage_body(complete.usage)}
    if complete.finish_reason == pb.FINISH_REASON_LENGTH:
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    elif complete.finish_reason == pb.FINISH_REASON_CONTENT_FILTER:
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "content_filter"}
    else:
        body["status"], body["completed_at"] = "completed", int(time.time())
    if body["status"] == "incomplete":
        for item in output:
            if item["type"] == "message":
                item["status"] = "incomplete"
        if output and output[-1]["type"] == "function_call" and complete.finish_reason == pb.FINISH_REASON_LENGTH:
            output[-1]["status"] = "incomplete"  # the call the limit cut: its arguments may not be whole JSON
    return body


def failed(base: Mapping[str, Any], output: list[dict[str, Any]], error: ApiError) -> dict[str, Any]:
    """``base`` failed: ResponseError's code is one of a few (rate_limit_exceeded, else server_error)."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {**base, "status": "failed", "output": output, "error": {"code": code, "message": error.message}}


def _message_output(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [text_part("output_text", text)]
    return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}


def _call_output(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# -- the event stream -------------------------------------------------------------------------


class ResponseEvents:
    """The Responses event stream of one run (``app.Chunks``): ``event: <type>`` / ``data: <json>`` pairs,
    ``sequence_number`` counting from 0.

    response.created, response.in_progress, then per output item: output_item.added, for a message
    content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done
    (a message ends where another item starts); for a function call function_call_arguments.delta...
    Function calls stay open to the end (a run's fragments of several calls may interleave: no delta
    may follow its item's done): their function_call_arguments.done and output_item.done come before
    the last event, in output order. Last: response.completed (response.incomplete at the token
    limit), or response.failed. ``ended`` is called once with the final Response (to store it), also
    by :meth:`cancelled` when the client leaves mid-stream (unless the final Response was made).

    The text of an open item is kept as its pieces, joined when it closes or the Response ends (a
    ``+=`` per delta would copy the whole text each time: quadratic in the deltas).
    """

    def __init__(self, base: dict[str, Any], ended: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.base = base
        self.ended = ended
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        """The message item being streamed."""
        self._calls: dict[int, dict[str, Any]] = {}
        """Function-call items by the run's tool-call index."""
        self._pieces: dict[str, list[str]] = {}
        """The text (message) or arguments (function call) of each open item so far, by item id."""
        self._index: dict[str, int] = {}
        """Each item's output index, by item id."""

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(payload) + b"\n\n"

    def first(self) -> bytes:
        """response.created and response.in_progress."""
        return self._event("response.created", response=self.base) + self._event(
            "response.in_progress", response=self.base
        )

    def delta(self, delta: pb.RunDelta) -> bytes:
        """Text as output_text.delta events, tool-call fragments as function_call_arguments.delta
        events, opening output items as they start (and closing the message another item follows)."""
        out: list[bytes] = []
        if delta.text:
            if self._message is None:
                out.append(self._open_message())
            assert self._message is not None
            self._pieces[self._message["id"]].append(delta.text)
            where = self._where(self._message)
            out.append(
                self._event("response.output_text.delta", **where, content_index=0, delta=delta.text, logprobs=[])
            )
        for fragment in delta.tool_calls:
            item = self._calls.get(fragment.index)
            if item is None:
                out.append(self._close_message())
                item = _call_output(new_id("fc"), fragment.id, fragment.function_name, "", "in_progress")
                self._calls[fragment.index] = item
                out.append(self._add(item))
            if fragment.arguments:
                self._pieces[item["id"]].append(fragment.arguments)
                where = self._where(item)
                out.append(self._event("response.function_call_arguments.delta", **where, delta=fragment.arguments))
        return b"".join(out)

    def last(self, complete: pb.RunComplete) -> bytes:
        """The open items closed, then response.completed (or response.incomplete)."""
        opened = b"" if self.output else self._open_message()  # a run that said nothing: an (empty) message
        last = self.output[-1]
        cut = complete.finish_reason == pb.FINISH_REASON_LENGTH and last["type"] == "function_call"
        out = opened + self._close_all(last["id"] if cut else None)  # a call the limit cut ends incomplete
        body = finished(self.base, self.output, complete)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        self._end(body)
        return out + self._event(kind, response=body)

    def error(self, error: ApiError) -> bytes:
        """response.failed with the error (the items streamed so far as they were)."""
        self._join()
        body = failed(self.base, self.output, error)
        self._end(body)
        return self._event("response.failed", response=body)

    def cancelled(self) -> None:
        """The client left mid-stream (the run is cancelled): the Response ends ``cancelled`` with the
        items streamed so far, so that its id, already sent, still finds it. After :meth:`last` or
        :meth:`error` (the client left during the final write), nothing: that Response is the one."""
        if self.ended is not None:
            self._join()
            self._end({**self.base, "status": "cancelled", "output": self.output})

    def _end(self, body: dict[str, Any]) -> None:
        ended, self.ended = self.ended, None
        if ended is not None:
            ended(body)

    def _join(self) -> None:
        """Each open item's text or arguments, as streamed so far, put in the item."""
        for item in self.output:
            if (pieces := self._pieces.get(item["id"])) is not None:
                _set_text(item, "".join(pieces))

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _add(self, item: dict[str, Any]) -> bytes:
        self._index[item["id"]] = len(self.output)
        self._pieces[item["id"]] = []
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))

    def _open_message(self) -> bytes:
        item = self._message = _message_output(new_id("msg"), "", "in_progress")
        added = self._add(item)
        part = text_part("output_text", "")
        return added + self._event("response.content_part.added", **self._where(item), content_index=0, part=part)

    def _close_message(self) -> bytes:
        item, self._message = self._message, None
        return b"" if item is None else self._close(item)

    def _close_all(self, cut: str | None = None) -> bytes:
        """Every item still open, in output order (``cut``: the id of one that ends incomplete)."""
        self._message = None
        return b"".join(
            self._close(item, "incomplete" if item["id"] == cut else "completed")
            for item in self.output
            if item["status"] == "in_progress"
        )

    def _close(self, item: dict[str, Any], status: str = "completed") -> bytes:
        _set_text(item, "".join(self._pieces.pop(item["id"], ())))
        where = self._where(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            )
            out.append(self._event("response.content_part.done", **where, content_index=0, part=_copy(part)))
        else:
            done = {"name": item["name"], "arguments": item["arguments"]}
            out.append(self._event("response.function_call_arguments.done", **where, **done))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=_copy(item)))
        return b"".join(out)


def _set_text(item: dict[str, Any], text: str) -> None:
    if item["type"] == "message":
        item["content"][0]["text"] = text
    else:
        item["arguments"] = text


def _copy(item: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (it changes as the stream goes on)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied
