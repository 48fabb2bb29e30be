"""Unit tests of the intake's pure parts: key table, detokenizer, error mapping, settings, CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvmesh.cli import COMMANDS
from kvmesh_core.text_stream import TextStream
from kvmesh_core.tokenizer import ByteTokenizer
from schemas.messages import Completion
from services.intake.auth import DEV_TENANT, ApiKeyTable, parse_key_spec
from services.intake.config import IntakeSettings
from services.intake.errors import AuthenticationFailed, IntakeError, UpstreamFailed, UpstreamRejected
from services.intake.replies import completion_error


def test_parse_key_spec() -> None:
    assert parse_key_spec("k1:tenantA, k2:tenantB\n# comment\nk3:tenantA  # trailing") == {
        "k1": "tenantA",
        "k2": "tenantB",
        "k3": "tenantA",
    }
    with pytest.raises(ValueError) as info:
        parse_key_spec("sk-secret-without-tenant")
    assert "sk-secret" not in str(info.value)


def test_key_table_maps_bearer_keys_to_tenants() -> None:
    table = ApiKeyTable({"sk-1": "a", "sk-2": "b"})
    assert table.tenant_for("Bearer sk-1") == "a"
    assert table.tenant_for("bearer  sk-2 ") == "b"
    for header in (None, "", "Bearer", "Bearer sk-3", "Basic sk-1", "sk-1"):
        with pytest.raises(AuthenticationFailed):
            table.tenant_for(header)
    assert "sk-1" not in repr(table)
    assert ApiKeyTable().tenant_for(None) == DEV_TENANT


def test_keys_from_env_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-file:tenantF\n", encoding="utf-8")
    monkeypatch.setenv("KVMESH_API_KEYS", "sk-env:tenantE")
    monkeypatch.setenv("KVMESH_API_KEYS_FILE", str(keys))
    caplog.set_level(logging.DEBUG)
    settings = IntakeSettings()
    table = ApiKeyTable.from_settings(settings)
    assert table.tenant_for("Bearer sk-env") == "tenantE"
    assert table.tenant_for("Bearer sk-file") == "tenantF"
    assert "sk-env" not in caplog.text + repr(settings)
    assert "dev mode" not in caplog.text


def test_settings_defaults_bind_loopback() -> None:
    s = IntakeSettings()
    assert (s.host, s.port, s.model_name, s.block_size) == ("127.0.0.1", 8000, "kvmesh-tiny", 16)
    assert s.public_prefixes == {}


def test_detokenizer_never_splits_a_character() -> None:
    det = TextStream(ByteTokenizer())
    ids = list("héllo €".encode())
    deltas = [det.push([i]) for i in ids]
    assert "".join(deltas) + det.flush() == "héllo €"
    # "é" is two bytes: nothing is emitted after its first byte.
    assert deltas[1] == "" and deltas[2] == "é"
    assert all("\ufffd" not in d for d in deltas)


def _completion(reason: str) -> Completion:
    return Completion("r", "s", "w", reason, 10, 0, error="CUDA OOM at 0xdeadbeef")  # type: ignore[arg-type]


def test_completion_errors() -> None:
    assert completion_error(_completion("stop")) is None
    assert completion_error(_completion("length")) is None
    assert isinstance(completion_error(_completion("rejected")), UpstreamRejected)
    err = completion_error(_completion("error"))
    assert isinstance(err, UpstreamFailed) and err.status == 502
    assert "0xdeadbeef" not in err.message  # worker internals stay inside the fleet
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert isinstance(err, IntakeError)


def test_intake_command_is_registered() -> None:
    from services.intake.__main__ import main

    assert COMMANDS["intake"][0] == "services.intake.__main__"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
