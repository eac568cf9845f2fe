"""Chat messages between OpenAI's form and the chat template's, and an answer read for tool
calls."""

from __future__ import annotations

import json
from collections.abc import Callable

from jaxpaged.errors import InvalidRequestError
from jaxpaged.server import protocol as api
from jaxpaged.server.errors import APIError
from jaxpaged.server.tool_calls import ToolCallStream


def template_message(index: int, message: api.ChatMessage) -> dict:
    """A message as chat templates read it (Hugging Face's convention): text content, an
    assistant's `tool_calls` with their arguments as a mapping, a tool's `tool_call_id`."""
    out = {"role": message.role, "content": text_content(message)}
    if message.tool_calls:
        out["tool_calls"] = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as e:
                raise APIError(f"messages[{index}].tool_calls[{j}].function.arguments is not "
                               f"JSON: {e}", param="messages") from e
            out["tool_calls"].append({"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": arguments}})
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def answer_message(text: str, finish_reason: str | None,
                       tool_calls: Callable[[], ToolCallStream] | None
                       ) -> tuple[api.AssistantMessage, str | None]:
    """A finished choice's message and finish reason from its answer text, its tool calls read
    if there are tools."""
    if tool_calls is None:
        return api.AssistantMessage(content=text), finish_reason
    reader = tool_calls()
    reader.feed(text, final=True)
    calls = [api.ToolCall(id=call.id, function=api.FunctionCall(
        name=call.name, arguments=call.arguments)) for call in reader.calls]
    content = reader.content if reader.content.strip() or not calls else None
    return (api.AssistantMessage(content=content, tool_calls=calls),
            reader.finish_reason(finish_reason))


def has_constraint(req: api.ChatCompletionRequest) -> bool:
    """Whether the chat request sets a structured-output constraint (tool calls included)."""
    try:
        return req.constraint() is not None
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.param) from e


def text_content(message: api.ChatMessage) -> str:
    """A message's text; content parts other than text get a 400."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(f"content part of type {part.type!r} is not supported; only text",
                           param="messages")
        parts.append(part.text)
    return "\n".join(parts)
