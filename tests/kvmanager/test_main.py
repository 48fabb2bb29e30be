"""Wiring of ``kvmesh kvmanager``: arguments and environment become one settings object."""

from __future__ import annotations

import pytest

from services.kvmanager.__main__ import build_parser, settings_from_args


def test_args_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_KVMANAGER_LIVENESS_TIMEOUT_MS", "7000")
    monkeypatch.setenv("KVMESH_KVMANAGER_REDIS__URL", "redis://127.0.0.1:1/0")
    s = settings_from_args(build_parser().parse_args(["--kafka", "127.0.0.1:19092"]))
    assert s.kafka.bootstrap_servers == "127.0.0.1:19092"
    assert s.redis.url == "redis://127.0.0.1:1/0"
    assert s.liveness_timeout_ms == 7000
    s = settings_from_args(build_parser().parse_args(["--liveness-timeout-ms", "900", "--manager-id", "m2"]))
    assert (s.liveness_timeout_ms, s.manager_id) == (900, "m2")
