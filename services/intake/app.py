"""The FastAPI app factory. Nothing connects at import time: the lifespan builds the service."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh_core.runtime import tune_gc
from kvmesh_core.tokenizer import Tokenizer
from services.intake.config import IntakeSettings
from services.intake.errors import IntakeError
from services.intake.routes import ROUTERS
from services.intake.service import IntakeService


def create_app(
    settings: IntakeSettings | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    tune_gc_on_start: bool = False,
) -> FastAPI:
    """An intake app; its lifespan starts an :class:`IntakeService` (Kafka) and stops it at shutdown.

    ``tune_gc_on_start``: once started, apply kvmesh_core.runtime.tune_gc, as every kvmesh service process
    does (``kvmesh intake`` sets it; an app embedded in another process, or in tests, leaves the
    process's collector alone).
    """
    settings = settings or IntakeSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = IntakeService(settings, tokenizer=tokenizer)
        await service.start()
        app.state.service = service
        app.state.started_s = int(time.time())
        if tune_gc_on_start:
            tune_gc()
        try:
            yield
        finally:
            app.state.service = None
            await service.stop()

    app = FastAPI(title="kvmesh intake", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = None
    app.state.started_s = int(time.time())

    @app.exception_handler(IntakeError)
    async def _intake_error(request: Request, exc: IntakeError) -> JSONResponse:
        # Every refused request is counted here by its code; errors inside a stream count in the stream.
        service = getattr(request.app.state, "service", None)
        if service is not None:
            service.metrics.requests.labels(exc.code or "error").inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods answer in OpenAI's error shape too: clients parse only that.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    for router in ROUTERS:
        app.include_router(router)
    return app
