"""HTTP routes of the intake, one module per resource; ``app.py`` only assembles them."""

from services.intake.routes import chat, completions, health, models, tokenize

ROUTERS = (chat.router, completions.router, tokenize.router, models.router, health.router)
