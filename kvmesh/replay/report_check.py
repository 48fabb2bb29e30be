"""Replays drop the LoadReports the live scheduler dropped: those that do not verify under the fleet
secret (``KVMESH_FLEET_SECRET``, as the services read it). Without it every report is applied, as in
a dev fleet, so a recording of a signed fleet replays exactly only with its secret."""

from __future__ import annotations

import functools
import os

from schemas.report_signing import ReportCheck


@functools.cache
def env_report_check() -> ReportCheck:
    secret = os.environ.get("KVMESH_FLEET_SECRET", "")
    return ReportCheck(secret.encode() if secret else None)
