"""Which environment variables a service's settings class reads: the check behind the compose file's
and the Kubernetes manifests' tests (a misspelt variable is silently ignored at run time)."""

from __future__ import annotations

from typing import Any


def aliases(cls: Any) -> set[str]:
    """Upper-case validation aliases of ``cls``'s fields (``KVMESH_FLEET_SECRET``, ...)."""
    out: set[str] = set()
    for f in cls.model_fields.values():
        alias = f.validation_alias
        choices = getattr(alias, "choices", None) or ([alias] if isinstance(alias, str) else [])
        out.update(c for c in choices if isinstance(c, str) and c.isupper())
    return out


def reads(cls: Any, prefix: str, var: str) -> bool:
    """Whether ``cls`` reads ``var``: an alias, ``PREFIX + FIELD`` or ``PREFIX + FIELD__SUBFIELD``."""
    if var in aliases(cls):
        return True
    if not var.startswith(prefix):
        return False
    model: Any = cls
    path = var[len(prefix) :].lower().split("__")
    for i, part in enumerate(path):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        if i < len(path) - 1:
            model = fields[part].annotation
    return True
