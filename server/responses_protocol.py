"""The Responses API's request and response bodies (`/v1/responses`), OpenAI's fields, checked
by pydantic; see `server.responses` for how a request is served."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from jaxpaged.server import protocol as api
from jaxpaged.server.tool_calls import FUNCTION_NAME_PATTERN

# -- request ---------------------------------------------------------------------------------

class InputText(api._Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output's, sent back: not used
    logprobs: list[Any] | None = None


class MessageItem(api._Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(api._Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(api._Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(api._Request):
    """An earlier response's reasoning sent back: dropped (chat templates leave it out)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(api._Request):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(api._Request):
    type: Literal["function"]
    name: str


class TextFormat(api._Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(api._Request):
    format: TextFormat | None = None


class ResponsesRequest(api._Request):
    """`POST /v1/responses` (OpenAI's fields this server serves; `priority` is vLLM's)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted, unused
    background: bool = False  # true is refused: responses run in the foreground
    truncation: Literal["disabled", "auto"] = "disabled"  # "auto" is refused
    priority: int = 0

    @classmethod
    def _item_type(cls, item):
        # An item without a type is a message (OpenAI's EasyInputMessage).
        if isinstance(item, dict) and "type" not in item and "role" in item:
            return {"type": "message", **item}
        return item

    @field_validator("input", mode="before")
    @classmethod
    def _messages_typed(cls, value):
        return [cls._item_type(item) for item in value] if isinstance(value, list) else value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value):
        # OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512.
        if value is not None and (len(value) > 16 or any(
                len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("metadata holds at most 16 pairs, keys of at most 64 characters "
                             "and values of at most 512")
        return value


# -- the served route ------------------------------------------------------------------------

class Response(BaseModel):
    """The response object (`object: "response"`); items are plain dicts of OpenAI's shapes."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    output: list[dict] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool
    temperature: float
    top_p: float
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    truncation: str
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: dict | None = None


# Error params of the chat path, named as this route's fields.
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text",
           "structured_outputs": "text"}
