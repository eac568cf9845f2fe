"""The server's errors: OpenAI's error body, request bodies checked by pydantic."""

from __future__ import annotations

import pydantic
from pydantic import BaseModel

from jaxpaged.errors import EngineDeadError, RequestFailedError
from jaxpaged.server import protocol as api


class APIError(Exception):
    """An error answered with OpenAI's body `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        return api.ErrorResponse(error=api.ErrorInfo(
            message=str(self), type=self.type, param=self.param, code=self.code)).model_dump()


def parse_body(model: type[BaseModel], body: bytes | str | dict) -> BaseModel:
    """A request body (JSON text, or already decoded) as `model`; 400 naming the first bad
    field (the top-level field in `param`, its full path in the message)."""
    try:
        if isinstance(body, dict):
            return model.model_validate(body)
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(part) for part in first["loc"])
        raise APIError(f"{path}: {first['msg']}" if path else first["msg"],
                       param=str(first["loc"][0]) if first["loc"] else None) from e


def failed_in_engine(e: RequestFailedError | EngineDeadError) -> APIError:
    """The 500 of a request that failed in the engine, with the reason."""
    what = "the request failed in the engine" if isinstance(e, RequestFailedError) else \
        "the engine stopped on a fatal fault"
    return APIError(f"{what}: {e}", 500, type="server_error")
