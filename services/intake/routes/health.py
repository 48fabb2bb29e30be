"""``GET /healthz`` (liveness + fleet connection), ``GET /readyz`` (readiness: a request sent now can be
served) and ``GET /metrics`` (Prometheus text).

A load balancer sends traffic only to ready intakes; an orchestrator restarts only unhealthy ones. A
broker outage or a fleet without live workers makes intake unready, never unhealthy: restarting it
would not help."""

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


@router.get("/readyz")
async def readyz(service: ServiceDep) -> Response:
    if service.client.started and service.client.publish_failures:
        # unready sends no traffic, so no publish would ever show the broker is back: ask it
        await service.client.probe()
    ok, checks = service.readiness()
    body = {"status": "ready" if ok else "unready", **checks}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
