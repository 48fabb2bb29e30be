"""``GET /healthz`` (liveness + fleet connection) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from services.intake.metrics import CONTENT_TYPE_LATEST
from services.intake.routes.deps import ServiceDep

router = APIRouter()


@router.get("/healthz")
async def healthz(service: ServiceDep) -> Response:
    ok = service.client.started
    body = {"status": "ok" if ok else "unavailable", "in_flight": service.in_flight}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
