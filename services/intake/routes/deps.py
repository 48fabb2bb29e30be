"""Request-scoped dependencies: the intake service of the app serving the request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.intake.errors import ServiceUnavailable
from services.intake.service import IntakeService


def get_service(request: Request) -> IntakeService:
    service: IntakeService | None = getattr(request.app.state, "service", None)
    if service is None:
        raise ServiceUnavailable("The intake is starting or stopping.")
    return service


ServiceDep = Annotated[IntakeService, Depends(get_service)]
