"""Errors of the scheduler package."""

from __future__ import annotations

from kvmesh_core.errors import KvmeshError


class SchedulerError(KvmeshError):
    """Base of every error the scheduler raises on purpose."""


class UnknownPolicy(SchedulerError):
    """``RouterSettings.policy`` names no policy of ``policies.POLICIES``."""


class TooManyWorkers(SchedulerError):
    """The prefix index interns worker ids into 14 bits; more distinct workers than that were seen."""


class SnapshotError(SchedulerError):
    """The KV manager's directory snapshot could not be read; the scheduler falls back to replaying."""

    retriable = True
