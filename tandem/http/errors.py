"""Errors the edge returns, all in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure (bad JSON, a bad field, auth, backpressure, a bug) is raised as an
:class:`ApiError` or converted into one by :func:`handle_error`, the app's single
error handler, so clients always get the same body whatever went wrong.
"""

from __future__ import annotations

import json
import logging

import falcon

log = logging.getLogger("tandem.edge")

_STATUS = {
    400: falcon.HTTP_400,
    401: falcon.HTTP_401,
    404: falcon.HTTP_404,
    405: falcon.HTTP_405,
    413: falcon.HTTP_413,
    415: falcon.HTTP_415,
    500: falcon.HTTP_500,
    503: falcon.HTTP_503,
}


class ApiError(Exception):
    """An error response. ``message`` says what the client must change."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> ApiError:
    suffix = f": {why}" if why else ""
    return ApiError(400, f"{param!r} is not supported by this server{suffix}", param=param, code="unsupported_parameter")


def busy(reason: str, retry_after_s: float, detail: str = "") -> ApiError:
    seconds = max(1, int(retry_after_s + 0.999))
    why = detail if detail and detail != reason else reason
    return ApiError(
        503,
        f"the server is at capacity ({why}); retry after {seconds} s",
        type="server_overloaded",
        code=reason or "busy",
        headers={"Retry-After": str(seconds)},
    )


def unavailable(detail: str = "") -> ApiError:
    message = "no inference backend is reachable; retry later"
    return ApiError(503, message + (f" ({detail})" if detail else ""), type="service_unavailable", code="unavailable")


def _from_falcon(ex: falcon.HTTPError) -> ApiError:
    status = int(str(ex.status).split()[0]) if not isinstance(ex.status, int) else ex.status
    kind = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error"}.get(status, "invalid_request_error")
    message = ex.description or ex.title or "request failed"
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}.get(status)
    return ApiError(status, message, type=kind, code=code)


def render(resp: falcon.asgi.Response, err: ApiError) -> None:
    resp.status = _STATUS.get(err.status, falcon.code_to_http_status(err.status))
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(err.body())
    for name, value in err.headers.items():
        resp.set_header(name, value)


async def handle_error(req, resp, ex, params) -> None:
    """The one error handler: every exception leaves the app as an OpenAI error body."""
    if isinstance(ex, ApiError):
        err = ex
    elif isinstance(ex, falcon.HTTPError):
        err = _from_falcon(ex)
    else:
        log.exception("unhandled error on %s %s", req.method, req.path)
        err = ApiError(500, "internal server error; see the edge log", type="server_error", code="internal_error")
    render(resp, err)
