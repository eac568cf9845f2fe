"""A streamed response's output items and typed events (`/v1/responses` with `stream: true`):
OpenAI's event names and fields, each an SSE `event:` line with its `data:` and a sequence
number; see `server.responses` for the order they come in."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator


def item_status(finish_reason: str | None) -> str:
    """An output item's status: "incomplete" when max_output_tokens cut the response."""
    return "incomplete" if finish_reason == "length" else "completed"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseEvents:
    """Grows a response's `output` items as deltas come and writes the events that say so.

    At most one reasoning and one message item are open at a time; function calls stay open
    until the response ends. Each method returns the events to send, in order.

    Args:
      output: the response's `output` list, appended to and updated in place.
    """

    def __init__(self, output: list[dict]):
        self.output = output
        self._numbers = itertools.count()
        self._open: dict[str, int] = {}  # "reasoning" / "message" -> the open item's index
        self._calls: dict[int, int] = {}  # tool call index -> its item's index

    def event(self, kind: str, **fields) -> str:
        """One SSE event of type `kind`, numbered."""
        data = {"type": kind, "sequence_number": next(self._numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _add_item(self, item: dict) -> Iterator[str]:
        self.output.append(item)
        index = len(self.output) - 1
        if item["type"] == "function_call":
            yield self.event("response.output_item.added", output_index=index, item=item)
            return
        yield self.event("response.output_item.added", output_index=index,
                         item={**item, "content": []})
        if item["type"] == "message":
            yield self.event("response.content_part.added", item_id=item["id"],
                             output_index=index, content_index=0, part=item["content"][0])

    def reasoning(self, delta: str) -> Iterator[str]:
        """Reasoning text: opens the reasoning item if none is open."""
        if "reasoning" not in self._open:
            self._open["reasoning"] = len(self.output)
            yield from self._add_item(reasoning_item(new_id("rs"), "", "in_progress"))
        index = self._open["reasoning"]
        self.output[index]["content"][0]["text"] += delta
        yield self.event("response.reasoning_text.delta", item_id=self.output[index]["id"],
                         output_index=index, content_index=0, delta=delta)

    def content(self, delta: str) -> Iterator[str]:
        """Answer text: closes the reasoning, opens the message item if none is open."""
        yield from self.close("reasoning")
        if "message" not in self._open:
            self._open["message"] = len(self.output)
            yield from self._add_item(message_item(new_id("msg"), "", "in_progress"))
        index = self._open["message"]
        self.output[index]["content"][0]["text"] += delta
        yield self.event("response.output_text.delta", item_id=self.output[index]["id"],
                         output_index=index, content_index=0, delta=delta, logprobs=[])

    def call(self, delta: dict) -> Iterator[str]:
        """A tool-call delta (OpenAI's chat chunk form): a new call opens its item."""
        for kind in ("reasoning", "message"):
            yield from self.close(kind)
        arguments = delta["function"]["arguments"]
        if "id" in delta:  # a new call
            self._calls[delta["index"]] = len(self.output)
            yield from self._add_item(call_item(new_id("fc"), delta["id"],
                                                delta["function"]["name"], "", "in_progress"))
        index = self._calls[delta["index"]]
        self.output[index]["arguments"] += arguments
        if arguments:
            yield self.event("response.function_call_arguments.delta",
                             item_id=self.output[index]["id"], output_index=index,
                             delta=arguments)

    def finish(self, status: str) -> Iterator[str]:
        """Closes every open item with `status`; an empty answer is an empty message, as when
        the response is not streamed."""
        if not self.output:
            self._open["message"] = 0
            yield from self._add_item(message_item(new_id("msg"), "", "in_progress"))
        for kind in ("reasoning", "message"):
            yield from self.close(kind, status)
        for index in self._calls.values():
            item = self.output[index]
            if item["status"] == "in_progress":
                item["status"] = status
                yield self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, name=item["name"],
                                 arguments=item["arguments"])
                yield self.event("response.output_item.done", output_index=index, item=item)

    def close(self, kind: str, status: str = "completed") -> Iterator[str]:
        """Closes the open `kind` item ("reasoning" or "message"), if one is open."""
        index = self._open.pop(kind, None)
        if index is None:
            return
        item = self.output[index]
        item["status"] = status
        if kind == "reasoning":
            yield self.event("response.reasoning_text.done", item_id=item["id"],
                             output_index=index, content_index=0,
                             text=item["content"][0]["text"])
        else:
            part = item["content"][0]
            yield self.event("response.output_text.done", item_id=item["id"],
                             output_index=index, content_index=0, text=part["text"],
                             logprobs=[])
            yield self.event("response.content_part.done", item_id=item["id"],
                             output_index=index, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)
