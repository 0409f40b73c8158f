"""OpenAI's error JSON `{"error": {"message", "type", "param", "code"}}` for every failure, and
on Anthropic's routes (/v1/messages...) Anthropic's `{"type": "error", "error": {"type", "message"}}`.

Bad input (validation, RequestError) is a 400, a busy or stopping engine a 503, a bug a 500:
never a traceback in the response. A stream that already started reports the same JSON as
its last event (exception_body).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hearth.errors import EngineStopped, QueueFull, RequestError, RequestFailed

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError",
               413: "RequestTooLargeError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        """code: OpenAI's error code where it has one (model_not_found); the status otherwise."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


ANTHROPIC_PATHS = "/v1/messages"  # the routes that answer in Anthropic's shapes (messages.py)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None, path: str = "", code: str | None = None) -> dict:
    """The error JSON of the API that `path` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": code or status}}


def error_response(status: int, message: str, param: str | None = None, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, path), status_code=status)


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for a body that failed validation (pydantic's errors), naming the first bad field."""
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
    return APIError(400, "invalid request: " + "; ".join(parts), param)


def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _from_exception(request, validation_error(exc.errors()))


STATUS_OF = {RequestError: 400, QueueFull: 503, EngineStopped: 503, RequestFailed: 500}  # hearth's exceptions a route may raise


def exception_body(e: Exception, path: str = "") -> tuple[int, dict]:
    """The status and error JSON of an exception, for a response or a stream's error event."""
    if isinstance(e, APIError):
        return e.status, error_body(e.status, e.message, e.param, path, e.code)
    status = next((code for cls, code in STATUS_OF.items() if isinstance(e, cls)), None)
    if status is None:
        return 500, error_body(500, f"internal error: {type(e).__name__}: {e}", path=path)
    return status, error_body(status, str(e), path=path)


def _from_exception(request: Request, e: Exception) -> JSONResponse:
    status, body = exception_body(e, request.url.path)
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException,
                              lambda request, e: error_response(e.status_code, str(e.detail), path=request.url.path))
    for cls in (APIError, *STATUS_OF, Exception):
        app.add_exception_handler(cls, _from_exception)
