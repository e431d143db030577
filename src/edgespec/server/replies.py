"""Errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) and the
status each failure maps to (docs/design.md 5.4): ``RequestError`` 400, ``StageFailure`` 500,
``RingBusy`` and ``NodeLost``/``RingError`` 503."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from edgespec import errors

# Ring failures that end a request with 503 (the ring is unusable right now).
_RING_ERRORS: tuple[type[BaseException], ...] = (errors.RingError,)


def _error(status: int, message: str, err_type: str, code: str | None = None,
           param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": err_type, "param": param, "code": code}})

def _failure(exc: BaseException) -> tuple[int, str, str | None, str | None]:
    """(status, type, code, param) for an exception raised while serving a request."""
    if isinstance(exc, errors.RequestError):
        return 400, "invalid_request_error", exc.code, exc.param
    if isinstance(exc, errors.RingBusy):
        return 503, "ring_busy", "ring_busy", None
    if isinstance(exc, errors.StageFailure):
        return 500, "server_error", exc.code, None
    if isinstance(exc, _RING_ERRORS):
        return 503, "ring_unavailable", "ring_unavailable", None
    return 500, "server_error", None, None


def _failure_message(exc: BaseException) -> str:
    if isinstance(exc, errors.RequestError):
        return str(exc)
    if isinstance(exc, errors.RingBusy):
        return f"the ring is busy: {exc}"
    if isinstance(exc, errors.StageFailure):
        return f"a stage failed: {exc}"
    if isinstance(exc, _RING_ERRORS):
        return f"the ring is unavailable: {exc}"
    return f"generation failed: {type(exc).__name__}: {exc}"
