"""`/v1/responses`: OpenAI's Responses API, served through the chat path.

A request's `instructions` (a system message) and `input` (a string, or a list of `message`,
`function_call` and `function_call_output` items; `reasoning` items are dropped) become a chat
conversation under the chat template; `tools` (functions), `tool_choice`, `text.format`,
`max_output_tokens`, `temperature` and `top_p` map onto a chat completion's fields, so a
request is checked and run as `/v1/chat/completions` runs it (tool-call parsing, structured
outputs, the reasoning parser). The response's `output` lists a `reasoning` item (with a
reasoning parser), the `message` and each `function_call`. Streamed, it is OpenAI's typed
events, each an SSE `event:` line with its `data:`: `response.created`,
`response.in_progress`, then per item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` +
`response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`
events and `response.output_item.done`, and last `response.completed` (`response.incomplete`
when `max_output_tokens` cut it, `response.failed` when the engine failed it).

`store` (OpenAI's default true) keeps a finished response and its conversation in this
process's memory, the newest `MAX_STORED_RESPONSES`: `previous_response_id` continues that
conversation (its instructions are not carried over, as in OpenAI's API), and
`GET`/`DELETE /v1/responses/{id}` read and drop it. Nothing survives a restart; `store: false`
keeps nothing, nor does a response that failed in the engine. A function call cut off by
`max_output_tokens` stays in its response but not in the stored conversation.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from jaxpaged.errors import EngineDeadError, RequestFailedError
from jaxpaged.outputs import RequestOutput
from jaxpaged.server import protocol as api
from jaxpaged.server.response_events import (ResponseEvents, call_item, item_status,
                                             message_item, new_id, reasoning_item)
from jaxpaged.server.responses_protocol import (CHAT_PARAMS, FunctionCallItem,
                                                FunctionCallOutputItem, FunctionToolChoice,
                                                MessageItem, Response, ResponsesRequest)
from jaxpaged.server.errors import APIError, failed_in_engine, parse_body
from jaxpaged.server.serving import OpenAIServing
from jaxpaged.server.streams import closing

MAX_STORED_RESPONSES = 1024


class ResponsesServing:
    """`/v1/responses` for one `OpenAIServing`, with the stored responses."""

    def __init__(self, serving: OpenAIServing, max_stored: int = MAX_STORED_RESPONSES):
        self.serving = serving
        self.max_stored = max_stored
        # id -> (the response, its conversation: chat messages without instructions)
        self.stored: collections.OrderedDict[str, tuple[Response, list[dict]]] = \
            collections.OrderedDict()

    async def create(self, req: ResponsesRequest) -> Response | AsyncIterator[str]:
        """The response, or an iterator of SSE strings when `req.stream`.

        Raises:
          APIError: 400 naming the field (an unknown `previous_response_id` included), 404
            for an unknown model.
        """
        if req.background:
            raise APIError("background responses are not supported", param="background")
        if req.truncation != "disabled":
            raise APIError('truncation "auto" is not supported: a conversation past the '
                           "context length is a 400", param="truncation")
        history = []
        if req.previous_response_id is not None:
            if req.previous_response_id not in self.stored:
                raise APIError(f"Previous response with id {req.previous_response_id!r} not "
                               "found (responses are kept in this server's memory, when "
                               "created with store true)", param="previous_response_id")
            history = self.stored[req.previous_response_id][1]
        conversation = history + _messages(req.input)
        chat = self._chat_request(req, conversation)
        response_id = new_id("resp")
        try:
            streams, tool_calls = await self.serving.start_chat(chat, response_id)
        except APIError as e:
            e.param = CHAT_PARAMS.get(e.param, e.param)
            raise
        head = self._response(req, response_id)
        if req.stream:
            return closing(self._events(req, head, conversation, streams, tool_calls), streams)
        [final] = await self.serving._final_outputs(streams)
        c = final.outputs[0]
        reasoning, message, finish_reason = self.serving.assistant_message(c, tool_calls)
        status = item_status(c.finish_reason)
        if reasoning:
            head.output.append(reasoning_item(new_id("rs"), reasoning, status))
        if message.content or not (reasoning or message.tool_calls):  # as the stream does
            head.output.append(message_item(new_id("msg"), message.content or "", status))
        head.output += [call_item(new_id("fc"), call.id, call.function.name,
                                   call.function.arguments, status)
                        for call in message.tool_calls]
        self._finish(head, final, len(c.token_ids), c.finish_reason, c.text, c.token_ids)
        self._store(req, head, conversation)
        return head

    def get(self, response_id: str) -> Response:
        """A stored response; 404 if there is none of that id."""
        if response_id not in self.stored:
            raise APIError(f"Response with id {response_id!r} not found.", 404,
                           code="not_found")
        return self.stored[response_id][0]

    def delete(self, response_id: str) -> dict:
        self.get(response_id)
        del self.stored[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    # -- helpers ------------------------------------------------------------------------------

    def _chat_request(self, req: ResponsesRequest, conversation: list[dict]
                      ) -> api.ChatCompletionRequest:
        """The chat completion request this response runs as."""
        messages = ([{"role": "system", "content": req.instructions}]
                    if req.instructions is not None else []) + conversation
        chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                                "parallel_tool_calls": req.parallel_tool_calls,
                                "priority": req.priority}
        for name in ("temperature", "top_p"):  # left out: the model's defaults apply
            if name in req.model_fields_set:
                chat[name] = getattr(req, name)
        if req.max_output_tokens is not None:
            chat["max_completion_tokens"] = req.max_output_tokens
        if req.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in req.tools]
        if isinstance(req.tool_choice, FunctionToolChoice):
            chat["tool_choice"] = {"type": "function",
                                   "function": {"name": req.tool_choice.name}}
        elif req.tool_choice is not None:
            chat["tool_choice"] = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError("text.format of type json_schema needs a schema", param="text")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        try:
            return parse_body(api.ChatCompletionRequest, chat)
        except APIError as e:
            e.param = CHAT_PARAMS.get(e.param, e.param)
            raise

    def _response(self, req: ResponsesRequest, response_id: str) -> Response:
        """The response as created: in progress, no output yet, the request's settings."""
        defaults = self.serving.defaults
        value = {name: getattr(req, name) if name in req.model_fields_set
                 else defaults.get(name, getattr(req, name)) for name in ("temperature", "top_p")}
        choice = req.tool_choice or ("auto" if req.tools else "none")
        return Response(
            id=response_id, created_at=int(time.time()), model=self.serving.model_name,
            status="in_progress", instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id, store=req.store,
            text={"format": ({"type": "text"} if req.text is None or req.text.format is None
                             else req.text.format.model_dump(by_alias=True, exclude_none=True))},
            tool_choice=(choice.model_dump() if isinstance(choice, BaseModel) else choice),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            truncation=req.truncation, metadata=req.metadata or {}, user=req.user, **value)

    def _finish(self, response: Response, final: RequestOutput, num_output_tokens: int,
                finish_reason: str | None, text: str, token_ids: list[int]) -> None:
        """Sets a finished response's status and usage (`text`, `token_ids`: the whole
        output)."""
        response.completed_at = int(time.time())
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = {"reason": "max_output_tokens"}
        else:
            response.status = "completed"
        num_input = len(final.prompt_token_ids)
        response.usage = {
            "input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": num_output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": self._reasoning_tokens(text, token_ids)},
            "total_tokens": num_input + num_output_tokens}

    def _reasoning_tokens(self, text: str, token_ids: list[int]) -> int:
        """Output tokens up to and including `</think>` (all of them if it never came) of an
        output that reasons."""
        think, parser = self.serving.think_token_ids, self.serving.reasoning
        if think is None or parser is None or parser.split(text)[0] is None:
            return 0
        return token_ids.index(think[1]) + 1 if think[1] in token_ids else len(token_ids)

    def _store(self, req: ResponsesRequest, response: Response, conversation: list[dict]
               ) -> None:
        """Keeps a finished response (with `store`) and its conversation: the input messages
        and the assistant's answer and calls."""
        if not req.store:
            return
        text = "".join(part["text"] for item in response.output if item["type"] == "message"
                       for part in item["content"])
        # A call cut off by max_output_tokens (arguments not JSON) is left out of the history:
        # the chat template could not render it.
        calls = [{"id": item["call_id"], "type": "function", "function": {
            "name": item["name"], "arguments": item["arguments"]}}
            for item in response.output
            if item["type"] == "function_call" and _is_json(item["arguments"])]
        answer = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls
                                                           else {})}
        self.stored[response.id] = (response, conversation + [answer])
        while len(self.stored) > self.max_stored:
            self.stored.popitem(last=False)

    async def _events(self, req: ResponsesRequest, response: Response, conversation: list[dict],
                      streams, tool_calls) -> AsyncIterator[str]:
        """The typed events of a streamed response (module doc)."""
        serving = self.serving
        events = ResponseEvents(response.output)
        snapshot = lambda: response.model_dump(mode="json")  # noqa: E731
        yield events.event("response.created", response=snapshot())
        yield events.event("response.in_progress", response=snapshot())
        split = serving.reasoning.stream() if serving.reasoning is not None else None
        reader = tool_calls() if tool_calls is not None else None
        final, num_tokens, token_ids, text_so_far = None, 0, [], ""
        try:
            async for _, out in serving._outputs(streams):
                c = out.outputs[0]
                done = c.finish_reason is not None
                num_tokens += len(c.token_ids)
                token_ids += c.token_ids
                text_so_far += c.text
                reasoning, text = (None, c.text) if split is None else split.feed(c.text, done)
                # The tool reader sees the answer only (a named function's call would otherwise
                # open before the reasoning).
                content, deltas = (text or "", []) if reader is None or not (
                    text or done or split is None) else reader.feed(text or "", done)
                for e in itertools.chain(
                        events.reasoning(reasoning) if reasoning else (),
                        events.content(content) if content else (),
                        *(events.call(delta) for delta in deltas),
                        events.finish(item_status(c.finish_reason)) if done else ()):
                    yield e
                final = out if done else final
            if final is None:
                raise RequestFailedError("the request was aborted")
        except (RequestFailedError, EngineDeadError) as e:
            response.status = "failed"
            response.error = {"code": "server_error", "message": str(failed_in_engine(e))}
            yield events.event("response.failed", response=snapshot())
            return
        c = final.outputs[0]
        self._finish(response, final, num_tokens, c.finish_reason, text_so_far, token_ids)
        self._store(req, response, conversation)
        kind = "response.incomplete" if response.status == "incomplete" else \
            "response.completed"
        yield events.event(kind, response=snapshot())


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _messages(input_: str | list) -> list[dict]:
    """The chat messages of a request's `input` (module doc): function calls join the
    assistant message before them, their outputs are `tool` messages."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not input_:
        raise APIError("input is empty", param="input")
    messages: list[dict] = []
    for item in input_:
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else \
                "\n".join(part.text for part in item.content)
            # chat templates know "system", not OpenAI's newer "developer"
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    if not messages:
        raise APIError("input has no message", param="input")
    return messages
