"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Clients (the openai package, the bench client) map the status to an exception and show `message`, so every
refusal says in one line what was wrong and, where it applies, which parameter.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
