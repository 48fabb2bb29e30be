"""Errors of the intake: each one knows its HTTP status and its OpenAI-style error body."""

from __future__ import annotations

from typing import Any

from kvmesh_core.errors import KvmeshError


class IntakeError(KvmeshError):
    """Base of every error the intake raises on purpose; rendered as ``{"error": {...}}``.

    ``status`` is the HTTP status, ``type`` and ``code`` follow the OpenAI API's vocabulary, ``param``
    names the offending request field (or None), ``headers`` go on the response (Retry-After, …).
    """

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(IntakeError):
    """The request body is not a valid chat completion request."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextTooLong(InvalidRequest):
    """Prompt plus requested completion exceeds the model's context or the tenant's prompt limit."""

    code = "context_length_exceeded"


class AuthenticationFailed(IntakeError):
    """No API key, or one that names no tenant."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(IntakeError):
    """The request names a model this deployment does not serve."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Overloaded(IntakeError):
    """This intake already has its maximum of requests in flight."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_requests"
    retriable = True


class UpstreamTimeout(IntakeError):
    """The fleet did not finish the request within the request timeout."""

    status = 504
    type = "timeout_error"
    code = "timeout"
    retriable = True


class UpstreamRejected(IntakeError):
    """The fleet refused the request (no worker could take it, deadline passed)."""

    status = 503
    type = "server_error"
    code = "rejected"
    retriable = True


class UpstreamFailed(IntakeError):
    """The worker serving the request failed."""

    status = 502
    type = "server_error"
    code = "worker_error"
    retriable = True


class ServiceUnavailable(IntakeError):
    """The intake is not connected to the fleet (starting or stopping)."""

    status = 503
    type = "server_error"
    code = "unavailable"
    retriable = True


class RequestTooLarge(InvalidRequest):
    """The body, or the fleet record it would become, is over the size limit."""

    status = 413
    code = "request_too_large"


class UnsupportedMediaType(InvalidRequest):
    """The body is not declared as JSON (a form or text post, as a browser page can send)."""

    status = 415
    code = "unsupported_media_type"
