"""HTTP routes of the intake, one module per resource; ``app.py`` only assembles them."""

from services.intake.routes import chat, health, models

ROUTERS = (chat.router, models.router, health.router)
