"""Scheduler settings from the environment, and the CLI's refusal of bad ones."""

from __future__ import annotations

import pytest

from services.scheduler.__main__ import main
from services.scheduler.config import SchedulerSettings


def test_env_prefix_and_nested_kafka(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_SCHEDULER_POLICY", "prefix_aware")
    monkeypatch.setenv("KVMESH_SCHEDULER_TENANT_MAX_INFLIGHT", "8")
    monkeypatch.setenv("KVMESH_SCHEDULER_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    s = SchedulerSettings()
    assert s.policy == "prefix_aware"
    assert s.kafka.bootstrap_servers == "127.0.0.1:19092"
    rs = s.router_settings()
    assert (rs.policy, rs.tenant_max_inflight) == ("prefix_aware", 8)
    assert s.view_settings().worker_timeout_ms == 10_000


def test_unknown_policy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_SCHEDULER_POLICY", "random")
    with pytest.raises(ValueError, match="unknown policy"):
        SchedulerSettings()
    assert main([]) == 2
