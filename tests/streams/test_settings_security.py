"""Kafka and Redis credentials: plain settings that reach aiokafka and redis-py, and never a repr or dump.

Also checks, by reading the source, that every aiokafka client and every Redis client of the library
is built from ``KafkaSettings.client_kwargs()`` / ``RedisSettings.client_kwargs()``: a client that
took only the bootstrap address or the URL would silently drop SASL, TLS or the Redis password.
Last, the record size limit as the typed producer enforces it.
"""

from __future__ import annotations

import ast
import asyncio
import ssl
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.asyncio.connection import SSLConnection

from schemas.blocks import block_hashes, tenant_namespace
from streams.settings import KafkaSettings, RedisSettings, redact_url

ROOT = Path(__file__).resolve().parents[2]
KAFKA_PASSWORD = "kafka-pw-7f3a9c"
REDIS_PASSWORD = "redis-pw-51be02"


def _sasl(protocol: str = "SASL_SSL", mechanism: str = "SCRAM-SHA-512") -> KafkaSettings:
    return KafkaSettings(
        bootstrap_servers="broker.example:9093",
        security_protocol=protocol,  # type: ignore[arg-type]
        sasl_mechanism=mechanism,  # type: ignore[arg-type]
        sasl_username="kvmesh-svc",
        sasl_password=SecretStr(KAFKA_PASSWORD),
    )


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_kwargs_carry_the_password_and_a_tls_context(mechanism: str) -> None:
    kw = _sasl(mechanism=mechanism).client_kwargs()
    assert kw["security_protocol"] == "SASL_SSL"
    assert kw["sasl_mechanism"] == mechanism
    assert kw["sasl_plain_username"] == "kvmesh-svc"
    assert kw["sasl_plain_password"] == KAFKA_PASSWORD
    assert isinstance(kw["ssl_context"], ssl.SSLContext)
    assert kw["bootstrap_servers"] == "broker.example:9093"


def test_sasl_plaintext_has_no_tls_context_and_plaintext_no_sasl() -> None:
    kw = _sasl(protocol="SASL_PLAINTEXT", mechanism="PLAIN").client_kwargs()
    assert kw["sasl_plain_password"] == KAFKA_PASSWORD and "ssl_context" not in kw
    plain = KafkaSettings().client_kwargs()
    assert plain["security_protocol"] == "PLAINTEXT"
    assert not {"sasl_mechanism", "sasl_plain_password", "ssl_context"} & set(plain)


def test_kafka_password_is_masked_in_repr_str_and_dumps() -> None:
    s = _sasl()
    for text in (repr(s), str(s), s.model_dump_json(), repr(s.model_dump()), f"{s}"):
        assert KAFKA_PASSWORD not in text
        assert "**********" in text  # pydantic's SecretStr mask: the field is there, its value is not
    assert s.model_dump()["sasl_password"].get_secret_value() == KAFKA_PASSWORD  # usable, not lost


def test_kafka_credentials_from_env_reach_every_service_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.intake.config import IntakeSettings
    from services.kvmanager.config import KvManagerSettings
    from services.scheduler.config import SchedulerSettings
    from services.worker.config import WorkerSettings

    monkeypatch.setenv("KVMESH_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KVMESH_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("KVMESH_KAFKA_SASL_USERNAME", "svc")
    monkeypatch.setenv("KVMESH_KAFKA_SASL_PASSWORD", KAFKA_PASSWORD)
    monkeypatch.setenv("KVMESH_REDIS_URL", "rediss://redis.example:6380/0")
    monkeypatch.setenv("KVMESH_REDIS_PASSWORD", REDIS_PASSWORD)
    monkeypatch.setenv("KVMESH_WORKER_FLEET_SECRET", "fleet-secret-for-this-test")
    services = [IntakeSettings(), KvManagerSettings(), SchedulerSettings(), WorkerSettings()]
    for settings in services:
        kw = settings.kafka.client_kwargs()  # type: ignore[attr-defined]
        assert kw["sasl_plain_password"] == KAFKA_PASSWORD, type(settings).__name__
        assert kw["sasl_mechanism"] == "SCRAM-SHA-256"
        for text in (repr(settings), settings.model_dump_json()):
            assert KAFKA_PASSWORD not in text and REDIS_PASSWORD not in text
            assert "fleet-secret-for-this-test" not in text
    for settings in services[1:3]:
        assert settings.redis.client_kwargs()["password"] == REDIS_PASSWORD  # type: ignore[attr-defined]


# -- every aiokafka client is built from client_kwargs() ------------------------------------------


class _Built(Exception):
    """Raised by a stand-in client's constructor, so nothing connects."""


def _capturing(captured: list[dict[str, Any]]) -> type:
    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            captured.append(kwargs)
            raise _Built

    return Client


async def test_every_streams_client_passes_the_sasl_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import streams.admin
    import streams.consumer
    import streams.producer
    import streams.recording
    from streams import topics

    kafka = _sasl()
    captured: list[dict[str, Any]] = []
    for module, name in (
        (streams.producer, "AIOKafkaProducer"),
        (streams.consumer, "AIOKafkaConsumer"),
        (streams.admin, "AIOKafkaAdminClient"),
        (streams.recording, "AIOKafkaConsumer"),
    ):
        monkeypatch.setattr(module, name, _capturing(captured))
    with pytest.raises(_Built):
        await streams.producer.TypedProducer(kafka, "p").start()
    with pytest.raises(_Built):
        await streams.consumer.TypedConsumer(kafka, [topics.REQUESTS], group_id="g").start()
    with pytest.raises(_Built):
        await streams.admin.ensure_topics(kafka)
    with pytest.raises(_Built):
        await streams.recording.record_topics(kafka, [topics.REQUESTS], tmp_path / "rec")
    assert len(captured) == 4
    for kw in captured:
        assert kw["sasl_plain_password"] == KAFKA_PASSWORD
        assert kw["security_protocol"] == "SASL_SSL" and isinstance(kw["ssl_context"], ssl.SSLContext)


def _calls(names: set[str]) -> list[tuple[Path, ast.Call]]:
    """Every call of a function or class named in ``names`` in the library (not the tests)."""
    found: list[tuple[Path, ast.Call]] = []
    for package in ("services", "streams", "kvmesh", "kvmesh_client", "kvmesh_core", "schemas"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in names:
                    found.append((path, node))
    return found


def _passes_client_kwargs(call: ast.Call) -> bool:
    """True if the call's keyword arguments are built from some ``X.client_kwargs()`` call."""
    for kw in call.keywords:
        for node in ast.walk(kw.value):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "client_kwargs"
            ):
                return True
    return False


def test_every_aiokafka_client_in_the_library_is_built_from_client_kwargs() -> None:
    calls = _calls({"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"})
    # producer, consumer, admin, recording and the streams benchmark (raw and typed paths)
    assert len(calls) >= 5
    bad = [f"{p.relative_to(ROOT)}:{c.lineno}" for p, c in calls if not _passes_client_kwargs(c)]
    assert bad == []


def test_every_redis_client_in_the_library_is_built_from_client_kwargs() -> None:
    """One place builds Redis clients (RedisSettings.connect: plain or cluster, with the settings'
    auth and timeouts); everything else calls it."""
    calls = _calls({"from_url", "Redis", "StrictRedis", "RedisCluster"})
    assert {p.relative_to(ROOT).as_posix() for p, _ in calls} == {"streams/settings.py"}
    assert len(calls) == 2  # a plain client and a cluster client
    bad = [f"{p.relative_to(ROOT)}:{c.lineno}" for p, c in calls if not _passes_client_kwargs(c)]
    assert bad == []
    users = _calls({"connect"})
    # kvmanager service, scheduler marks and cold start, directory CLI, kvmanager bench
    assert len({p for p, _ in users}) >= 4


# -- Redis ----------------------------------------------------------------------------------------


def _pool_kwargs(settings: RedisSettings) -> tuple[type, dict[str, Any]]:
    client = aioredis.from_url(settings.url, **settings.client_kwargs())  # builds a pool, connects nothing
    pool = client.connection_pool
    return pool.connection_class, pool.connection_kwargs


def test_rediss_url_with_password_builds_a_tls_client_with_auth() -> None:
    cls, kw = _pool_kwargs(RedisSettings(url=f"rediss://kvm:{REDIS_PASSWORD}@redis.example:6380/2"))
    assert issubclass(cls, SSLConnection)
    assert (kw["username"], kw["password"]) == ("kvm", REDIS_PASSWORD)
    assert (kw["host"], kw["port"], kw["db"]) == ("redis.example", 6380, 2)
    assert kw["socket_timeout"] == 2.0


def test_password_setting_reaches_redis_py_without_one_in_the_url() -> None:
    settings = RedisSettings(
        url="rediss://redis.example:6380/0", username="kvm", password=SecretStr(REDIS_PASSWORD)
    )
    cls, kw = _pool_kwargs(settings)
    assert issubclass(cls, SSLConnection)
    assert (kw["username"], kw["password"]) == ("kvm", REDIS_PASSWORD)
    plain_cls, plain_kw = _pool_kwargs(RedisSettings(url="redis://127.0.0.1:6379/0"))
    assert not issubclass(plain_cls, SSLConnection) and plain_kw.get("password") is None


def test_redis_password_in_url_or_setting_is_masked() -> None:
    settings = RedisSettings(url=f"rediss://kvm:{REDIS_PASSWORD}@redis.example:6380/0")
    for text in (repr(settings), str(settings), settings.model_dump_json(), settings.redacted_url):
        assert REDIS_PASSWORD not in text
        assert "rediss://kvm:***@redis.example:6380/0" in text
    assert settings.url.endswith("@redis.example:6380/0") and REDIS_PASSWORD in settings.url  # still usable
    other = RedisSettings(password=SecretStr(REDIS_PASSWORD))
    assert REDIS_PASSWORD not in repr(other) + other.model_dump_json()
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("rediss://:pw@h:1/0") == "rediss://:***@h:1/0"


def _capture_from_url(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    captured: list[tuple[str, dict[str, Any]]] = []

    def fake_from_url(url: str, **kwargs: Any) -> Any:
        captured.append((url, kwargs))
        raise _Built

    # kvmanager, scheduler and the directory CLI all call redis.asyncio.from_url through the module.
    monkeypatch.setattr(aioredis, "from_url", fake_from_url)
    return captured


async def test_kvmanager_and_scheduler_connect_with_the_redis_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.kvmanager.service as kvm_service
    from services.kvmanager.config import KvManagerSettings
    from services.scheduler.config import SchedulerSettings
    from services.scheduler.service import SchedulerService

    redis = RedisSettings(url="rediss://redis.example:6380/0", password=SecretStr(REDIS_PASSWORD))
    captured = _capture_from_url(monkeypatch)
    with pytest.raises(_Built):
        await kvm_service.KvManagerService(KvManagerSettings(redis=redis)).start()
    scheduler = SchedulerService(SchedulerSettings(redis=redis, use_snapshot=True))
    assert await scheduler._cold_start() == {}  # no snapshot: it replays kv-events instead
    assert [url for url, _ in captured] == ["rediss://redis.example:6380/0"] * 2
    assert all(kw["password"] == REDIS_PASSWORD for _, kw in captured)


def test_directory_cli_url_keeps_the_password_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.kvmanager.directory_cli as directory_cli

    captured = _capture_from_url(monkeypatch)
    monkeypatch.setenv("KVMESH_REDIS_PASSWORD", REDIS_PASSWORD)
    with pytest.raises(_Built):
        directory_cli.main(["--redis", "rediss://redis.example:6380/0", "--hashes", "1"])
    assert captured == [("rediss://redis.example:6380/0", captured[0][1])]
    assert captured[0][1]["password"] == REDIS_PASSWORD


# -- limits ---------------------------------------------------------------------------------------


async def test_oversized_record_is_refused_before_it_reaches_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``max_record_bytes`` is enforced by the typed producer (codec limits: tests/schemas/test_codec.py)."""
    import streams.producer
    from schemas.errors import RecordTooLarge
    from schemas.messages import ChatRequest
    from streams import topics

    sent: list[bytes] = []

    class FakeProducer:
        def __init__(self, **kwargs: Any) -> None:
            pass

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

        async def send(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
            sent.append(value)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

    def request(n_tokens: int) -> ChatRequest:
        tokens = [7] * n_tokens
        return ChatRequest(
            request_id="r",
            session_id="s",
            tenant="t",
            token_ids=tokens,
            block_hashes=block_hashes(tokens, 16, tenant_namespace("t")),
            block_size=16,
            max_tokens=1,
            arrival_ms=1,
            namespace=tenant_namespace("t"),
        )

    monkeypatch.setattr(streams.producer, "AIOKafkaProducer", FakeProducer)
    kafka = KafkaSettings(max_record_bytes=4096)
    async with streams.producer.TypedProducer(kafka, "p") as producer:
        await producer.send(topics.REQUESTS, request(64))
        with pytest.raises(RecordTooLarge, match="exceeds 4096"):
            await producer.send(topics.REQUESTS, request(4096))
    assert len(sent) == 1 and len(sent[0]) <= 4096
