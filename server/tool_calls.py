"""Tool calling: the constraint `tool_choice` puts on a chat's output, and the parsers that
turn a choice's text into OpenAI `tool_calls`, whole or as stream deltas.

`tool_choice` (OpenAI's meanings, vLLM's behaviour):
- `"none"`: the tools reach the chat template only; the answer is text.
- `"auto"`: the model decides. Its text is parsed with the server's `--tool-call-parser`
  (`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format of
  Hermes 2 Pro, Qwen2.5 and many others); text outside the blocks is the answer's content.
- `"required"`: the output is constrained (an llguidance Lark grammar) to a JSON array of one
  or more `{"name": ..., "parameters": {...}}` calls, each call's parameters meeting its
  function's JSON schema (exactly one call when `parallel_tool_calls` is false), as vLLM does.
- a named function: the output is constrained to that function's arguments (its JSON schema).

Every parser sees a choice's text as it grows and reports its content and calls so far, each a
prefix of its final value; `ToolCallStream` turns the growth into OpenAI's deltas, so a stream and
a whole answer come from the same parse.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import re
import uuid

from jaxpaged.sample.structured_outputs import JSON_DEFAULTS, StructuredOutputsParams

logger = logging.getLogger(__name__)

# OpenAI's rule for function names; it also keeps them free of characters that would need
# escaping in the grammar and in the parsers' patterns.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(parameters: dict | None) -> dict:
    """A function's `parameters` as the JSON schema its arguments must meet (none: `{}`)."""
    return NO_PARAMETERS if parameters is None else parameters


def required_calls_grammar(functions: dict[str, dict | None], parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of `tool_choice="required"`: a JSON array of
    `{"name": "<function>", "parameters": <arguments>}`, one or more (exactly one unless
    `parallel`), arguments per each function's schema. `functions`: name -> parameters."""
    calls = []
    for i, (name, parameters) in enumerate(functions.items()):
        schema = {"x-guidance": JSON_DEFAULTS, **parameters_schema(parameters)}
        head = json.dumps(f'{{"name": "{name}", "parameters": ')
        calls.append(f"call_{i}: {head} args_{i} \"}}\"\nargs_{i}: %json {json.dumps(schema)}")
    repeat = ' (", " call)*' if parallel else ""
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    return "\n".join([f'start: "[" call{repeat} "]"', f"call: {alternatives}", *calls])


def tool_constraint(functions: dict[str, dict | None], tool_choice: str | None,
                    parallel: bool) -> StructuredOutputsParams | None:
    """The constraint for `tool_choice` (a function's name when named); None for none/auto."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return StructuredOutputsParams(grammar=required_calls_grammar(functions, parallel))
    return StructuredOutputsParams(json=parameters_schema(functions[tool_choice]))


@dataclasses.dataclass
class ToolCall:
    """One call as parsed so far: `arguments` is JSON text (a prefix until complete)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolCallParser(abc.ABC):
    """Reads a choice's whole text so far; `final` once the text is complete."""

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        """(content, [(name, arguments)]) of `text`. Each must be a prefix of what it becomes
        as the text grows: content and arguments only gain characters at their ends, calls
        are only added at the end of the list."""


class NamedFunction(ToolCallParser):
    """A named `tool_choice`: the whole text is the arguments of one call."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text, final):
        return "", [(self.name, text)]


class RequiredCalls(ToolCallParser):
    """`tool_choice="required"`: the JSON array `required_calls_grammar` allows."""

    HEAD = re.compile(r'\{"name": "([a-zA-Z0-9_-]+)", "parameters": ')

    def parse(self, text, final):
        calls, pos = [], 0
        while (head := self.HEAD.search(text, pos)) is not None:
            start = head.end()
            end = _json_value_end(text, start)
            calls.append((head.group(1), text[start:end]))
            if end == len(text):
                break
            pos = end
        return "", calls


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes 2 Pro's
    format, also Qwen2.5's): vLLM's `hermes` parser. The text before the first block streams
    as content; after it, text outside blocks and blocks that are not a call are content once
    complete (the next block starts or the text ends). A call is reported when its block
    closes (or the text ends inside it)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text, final):
        first = text.find(self.OPEN)
        if first < 0:
            return (text if final else _hold_back(text, self.OPEN)), []
        content, calls, pos = [text[:first]], [], first
        while True:
            start = text.find(self.OPEN, pos)
            gap = text[pos:] if start < 0 else text[pos:start]
            if gap.strip() and (start >= 0 or final):
                content.append(gap)
            if start < 0:
                break
            end = text.find(self.CLOSE, start)
            if end < 0 and not final:
                break
            block_end = len(text) if end < 0 else end + len(self.CLOSE)
            call = self._call(text[start + len(self.OPEN):end if end >= 0 else len(text)])
            if call is None:
                content.append(text[start:block_end])
            else:
                calls.append(call)
            pos = block_end
        return "".join(content), calls

    @staticmethod
    def _call(body: str) -> tuple[str, str] | None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            logger.warning("a <tool_call> block is not a call; returned as content: %.200r", body)
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return call["name"], arguments


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


class ToolCallStream:
    """One choice's text in, its content and OpenAI tool-call deltas out."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None):
        """`max_calls`: calls kept at most (1 when `parallel_tool_calls` is false); later
        ones are dropped."""
        self.parser, self.max_calls = parser, max_calls
        self.text, self.content = "", ""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas as OpenAI's `{"index", "id", "type",
        "function": {"name", "arguments"}}`, the first three only in a call's first delta)
        after `delta` is appended to the text; `final` when the text is complete."""
        self.text += delta
        content, calls = self.parser.parse(self.text, final)
        content_delta, self.content = content[len(self.content):], content
        deltas = []
        for index, (name, arguments) in enumerate(calls[:self.max_calls]):
            if index == len(self.calls):
                self.calls.append(ToolCall(name, arguments))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": name, "arguments": arguments}})
                continue
            known = self.calls[index]
            if len(arguments) > len(known.arguments):
                deltas.append({"index": index, "function": {
                    "arguments": arguments[len(known.arguments):]}})
                known.arguments = arguments
        return content_delta, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a choice that stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.calls else reason


def _json_value_end(text: str, start: int) -> int:
    """Where the JSON value starting at `start` ends; `len(text)` if it is not complete."""
    start += len(text) - start - len(text[start:].lstrip())  # raw_decode takes no leading space
    try:
        return json.JSONDecoder().raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return len(text)


def _hold_back(text: str, tag: str) -> str:
    """`text` less any end of it that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text
