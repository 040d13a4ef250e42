"""ApiError: the one exception that becomes an HTTP error response.

Every error a client sees has OpenAI's shape `{"error": {"message", "type",
"param", "code"}}`; the `type` follows from the status so callers only choose the
status, the message and (for a bad field) the param it names.
"""
from __future__ import annotations

from typing import Optional

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, f"invalid '{param}': {message}", param=param, code="invalid_value")
