"""``GET /v1/models``: the one model this deployment serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from services.intake.openai_format import models_body
from services.intake.routes.deps import ServiceDep

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, service: ServiceDep) -> dict[str, Any]:
    service.keys.tenant_for(request.headers.get("authorization"))
    return models_body(service.settings.model_name, request.app.state.started_s)
