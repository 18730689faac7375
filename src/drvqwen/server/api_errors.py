"""The OpenAI-style error every refused request gets.

Shape (OpenAI API reference, "Error codes"): `{"error": {"message", "type", "param", "code"}}`,
with the HTTP status saying what kind of failure it is (400 bad field, 401 key, 403 a Host
not served, 404 route or model, 413 body too large, 415 a body not declared JSON, 503 queue
full or shutting down).
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    """A request refused with an HTTP status and an OpenAI-style JSON body.

    Args:
        status: the HTTP status (4xx for the client's mistakes, 503 for a full queue).
        message: one line saying what is wrong, naming the field and value.
        param: the request field at fault ("messages[1].content", "max_tokens"), or None.
        code: a short machine-readable code ("context_length_exceeded", "invalid_api_key").
        headers: extra response headers (Retry-After on 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 403:
            return "permission_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_field(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    """A 400 for request field `param`: the message starts with the field's name."""
    return APIError(400, f"{param}: {message}", param=param, code=code)
