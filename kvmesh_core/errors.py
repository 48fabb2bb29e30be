"""The one error and warning base of the kvmesh package (shared library code)."""


class KvmeshError(Exception):
    """Base of every error kvmesh raises on purpose. ``retriable`` says whether trying again may help."""

    retriable: bool = False


class KvmeshWarning(UserWarning):
    """Base of kvmesh's own warnings; the test suite turns these into errors."""
