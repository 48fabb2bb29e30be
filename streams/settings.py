"""Connection settings for Kafka and Redis, shared by every service's settings object.

Secrets are ``SecretStr``: they reach aiokafka and redis-py but never a log line, an event or a repr.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_serializer, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from streams.topics import TopicSpec


class KafkaSettings(BaseSettings):
    """How to reach the broker. Defaults fit the embedded dev broker on loopback.

    Read from ``KVMESH_KAFKA_*`` (e.g. ``KVMESH_KAFKA_BOOTSTRAP_SERVERS``) so that one environment
    configures every service of a host; a service's own settings may still override it.
    """

    model_config = SettingsConfigDict(env_prefix="KVMESH_KAFKA_", extra="ignore")

    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "kvmesh"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_record_bytes: int = 1 << 20
    # Short group timeouts make consumer groups join in seconds on small brokers (tansu) and in tests.
    session_timeout_ms: int = 6000
    rebalance_timeout_ms: int = 3000
    heartbeat_interval_ms: int = 500
    # tansu rejects InitProducerId, so idempotent producers are opt-in (turn on for a real Kafka cluster).
    enable_idempotence: bool = False
    # Prepended to every catalog topic name (see streams.admin.topic_name) so tests or a shared cluster
    # can namespace kvmesh's topics; empty in production.
    topic_prefix: str = ""
    # tansu answers a fetch only when fetch_max_wait_ms runs out, even if records arrived: that wait
    # is the per-hop latency floor (500 ms, aiokafka's default, means ~250 ms per hop). 25 ms costs an
    # idle consumer ~40 fetches/s (~1% of a core each, plus broker time). Kafka proper answers early,
    # so a larger value is fine there.
    fetch_max_wait_ms: int = 25
    # Partitions per catalog topic, overriding the catalog's defaults (streams.topics), e.g.
    # KVMESH_KAFKA_PARTITIONS='{"kvmesh.requests": 32, "kvmesh.assignments": 64}'. Used when topics
    # are created; consumers and the worker's own partition follow the broker's actual counts. See
    # docs/deploying.md for counts per fleet size.
    partitions: dict[str, int] = Field(default_factory=dict)

    @field_validator("partitions")
    @classmethod
    def _positive_partitions(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: n for k, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"partition counts must be at least 1: {bad}")
        return v

    def partitions_of(self, spec: TopicSpec) -> int:
        """The partition count to create catalog topic ``spec`` with."""
        return int(self.partitions.get(spec.name, spec.partitions))

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments common to AIOKafkaProducer and AIOKafkaConsumer."""
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            kw["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
            )
        if self.sasl_mechanism:
            kw["sasl_mechanism"] = self.sasl_mechanism
            kw["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                kw["sasl_plain_password"] = self.sasl_password.get_secret_value()
        return kw


def redact_url(url: str) -> str:
    """``url`` with the password of its user info (``scheme://user:password@host``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))


class RedisSettings(BaseSettings):
    """How to reach Redis: ``redis://`` or ``rediss://`` (TLS) with optional user and password.

    Read from ``KVMESH_REDIS_*`` (e.g. ``KVMESH_REDIS_URL``). The password may be ``password`` or part
    of the URL (``rediss://user:pw@host``); either way connect with ``from_url(url, **client_kwargs())``.
    ``url`` itself stays as given (redis-py reads it), so repr, str and JSON dumps show it redacted and
    log lines use :attr:`redacted_url`; only ``model_dump()`` in Python mode carries it whole.
    """

    model_config = SettingsConfigDict(env_prefix="KVMESH_REDIS_", extra="ignore")

    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: SecretStr | None = None
    socket_timeout_s: float = 2.0
    #: A Redis Cluster: ``url`` names any one node; the client discovers the rest and routes each
    #: command to the node that serves its key's slot.
    cluster: bool = False

    @property
    def redacted_url(self) -> str:
        """The URL safe for a log line: any password in it replaced by ``***``."""
        return redact_url(self.url)

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, (redact_url(value) if name == "url" else value)

    @field_serializer("url", when_used="json")
    def _url_without_password(self, url: str) -> str:
        return redact_url(url)

    def connect(self) -> Any:
        """An asyncio client: ``redis.asyncio.Redis``, or ``RedisCluster`` with ``cluster`` set. Both
        take the same commands; every multi-key command kvmesh sends stays within one hash slot."""
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster

            return RedisCluster.from_url(self.url, **self.client_kwargs())
        import redis.asyncio as aioredis

        return aioredis.from_url(self.url, **self.client_kwargs())

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``redis.asyncio.from_url(url, ...)`` beside the URL: timeouts and auth."""
        kw: dict[str, Any] = {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.socket_timeout_s,
        }
        if self.username:
            kw["username"] = self.username
        if self.password is not None:
            kw["password"] = self.password.get_secret_value()
        return kw
