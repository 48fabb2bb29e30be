"""The embedded default: broker + Redis + every service on loopback, as one process tree.

Used by ``kvmesh dev`` (foreground, Ctrl-C stops all), by ``kvmesh demo`` and ``kvmesh bench fleet``
when no stack is given, and by the end-to-end tests. Each service is a real child process started with
``python -m services.<name>``; their output is relayed line by line with a ``[name]`` prefix::

    DevStack.start()
      ├─ EmbeddedBroker (tansu)      127.0.0.1:<free port>
      ├─ EmbeddedRedis (redis-server) 127.0.0.1:<free port>
      ├─ ensure_topics
      ├─ kvmanager, scheduler         python -m services.X
      ├─ worker-0 .. worker-N-1       python -m services.worker --worker-id worker-i
      └─ intake                       127.0.0.1:<port>, ready when /healthz answers and every
                                      worker has published a LoadReport
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from streams.settings import KafkaSettings, RedisSettings

if TYPE_CHECKING:
    from streams.embedded import EmbeddedBroker, EmbeddedObjectStore, EmbeddedRedis

#: Backoff of supervised restarts: first delay, growth, cap; a child that ran this long resets it.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 15.0
RESTART_RESET_AFTER_S = 30.0

log = logging.getLogger("kvmesh.dev")


@dataclass
class DevStackSettings:
    """Shape of the embedded stack."""

    workers: int = 2
    #: KV managers: 1 is the one manager ("kvmanager"); more run as sharded replicas
    #: ("kvmanager-0", ...: one consumer group on kv-events, the leader by Redis lease).
    kvmanagers: int = 1
    intake_host: str = "127.0.0.1"
    intake_port: int = 8000
    policy: str = "kvmesh"
    gpu_blocks: int = 1024
    dram_blocks: int = 4096
    disk_blocks: int = 0
    #: "builtin" (the torch engine) or "vllm"; ``model`` is a built-in size or a local model directory.
    engine: str = "builtin"
    model: str = "tiny"
    #: The fleet's block size (workers, scheduler, intake, KV manager); None: the engine's default
    #: (16 for the built-in engine, 32 for vLLM, whose CPU backend needs a multiple of 32).
    block_size: int | None = None
    #: Context length of every worker (None: the model's) and the intake's limit to match.
    max_context: int | None = None
    api_keys: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    log_level: str = "INFO"
    ready_timeout_s: float = 120.0
    #: The broker keeps its topics and committed offsets in an object store (streams.local_s3, a
    #: process of its own, on disk) and Redis keeps an append-only file, so any of the three can be
    #: killed and restarted without losing what it held.
    durable: bool = False
    #: Where durable mode keeps the object store's files and Redis's append-only file (None: a
    #: temporary directory, removed at stop).
    data_dir: str | None = None
    #: Restart a service that dies, with exponential backoff (``kvmesh dev`` turns this on).
    supervise: bool = False
    #: Serve ``/metrics`` from every service on a free loopback port (``status()`` lists them).
    metrics: bool = True


class _Child:
    """One service process whose output is relayed with a prefix."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], sink: Callable[[str], object]
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._relay, args=(sink,), daemon=True, name=f"relay-{name}")
        self._thread.start()

    def _relay(self, sink: Callable[[str], object]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if len(self.lines) > 2000:
                del self.lines[:1000]
            sink(f"[{self.name}] {line}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


class DevStack:
    """Broker, Redis and all services. ``start()``/``stop()`` are safe twice; also a context manager."""

    def __init__(
        self, settings: DevStackSettings | None = None, sink: Callable[[str], None] | None = None
    ) -> None:
        self.settings = settings or DevStackSettings()
        self._sink: Callable[[str], object] = sink or (lambda line: sys.stderr.write(line + "\n"))
        self.broker: EmbeddedBroker | None = None
        self.redis: EmbeddedRedis | None = None
        self.object_store: EmbeddedObjectStore | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        #: name -> restarts by the supervisor (for tests and the chaos benchmark)
        self.restarts: dict[str, int] = {}
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.kafka = KafkaSettings()
        self.redis_settings = RedisSettings()
        self.children: dict[str, _Child] = {}
        self.intake_url = ""
        self.metrics_urls: dict[str, str] = {}
        self.fleet_secret = secrets.token_hex(16)
        self._env: dict[str, str] = {}
        self._started = False

    def __enter__(self) -> DevStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def worker_ids(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.settings.workers)]

    @property
    def kvmanager_names(self) -> list[str]:
        n = self.settings.kvmanagers
        return ["kvmanager"] if n <= 1 else [f"kvmanager-{i}" for i in range(n)]

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        from streams.admin import ensure_topics
        from streams.embedded import EmbeddedBroker, EmbeddedObjectStore, EmbeddedRedis, free_port

        s = self.settings
        self._stopping.clear()
        try:
            if s.durable:
                if s.data_dir is None:
                    self._tmp = tempfile.TemporaryDirectory(prefix="kvmesh-dev-")
                data = Path(s.data_dir or (self._tmp.name if self._tmp else "."))
                self.object_store = EmbeddedObjectStore(root=data / "s3")
                self.object_store.start()
                self.broker = EmbeddedBroker(
                    storage=self.object_store.storage, env=self.object_store.broker_env()
                )
                self.redis = EmbeddedRedis(aof_dir=data / "redis")
            else:
                self.broker = EmbeddedBroker()
                self.redis = EmbeddedRedis()
            bootstrap = self.broker.start()
            redis_url = self.redis.start()
            self.kafka = KafkaSettings(bootstrap_servers=bootstrap)
            self.redis_settings = RedisSettings(url=redis_url)
            asyncio.run(ensure_topics(self.kafka))
            port = s.intake_port or free_port()
            self.intake_url = f"http://{s.intake_host}:{port}"
            env = dict(os.environ)
            env.update(self._fleet_env(s))
            env.update(
                {
                    "KVMESH_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
                    "KVMESH_REDIS_URL": redis_url,
                    "KVMESH_WORKER_FLEET_SECRET": self.fleet_secret,
                    # the same secret signs workers' LoadReports; the other services verify them
                    "KVMESH_FLEET_SECRET": self.fleet_secret,
                    "KVMESH_WORKER_GPU_BLOCKS": str(s.gpu_blocks),
                    "KVMESH_WORKER_DRAM_BLOCKS": str(s.dram_blocks),
                    "KVMESH_WORKER_DISK_BLOCKS": str(s.disk_blocks),
                    "KVMESH_SCHEDULER_POLICY": s.policy,
                    "KVMESH_INTAKE_HOST": s.intake_host,
                    "KVMESH_INTAKE_PORT": str(port),
                    "PYTHONUNBUFFERED": "1",
                    "KVMESH_LOG_LEVEL": s.log_level,
                    # Two cores shared by several torch processes: one thread each avoids oversubscription.
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                }
            )
            if s.api_keys is not None:
                env["KVMESH_API_KEYS"] = s.api_keys
            env.update(s.extra_env)
            self._env = env
            self.metrics_urls = {"intake": f"{self.intake_url}/metrics"}
            for name in self.kvmanager_names:
                env_km = self._metrics_env(name, "KVMANAGER") or dict(self._env)
                if s.kvmanagers > 1:
                    env_km = {
                        **env_km,
                        "KVMESH_KVMANAGER_SHARDED": "true",
                        "KVMESH_KVMANAGER_MANAGER_ID": name,
                    }
                self._spawn(name, ["-m", "services.kvmanager"], env_km)
            self._spawn(
                "scheduler", ["-m", "services.scheduler"], self._metrics_env("scheduler", "SCHEDULER")
            )
            for wid in self.worker_ids:
                self._spawn(
                    wid, ["-m", "services.worker", "--worker-id", wid], self._metrics_env(wid, "WORKER")
                )
            self._spawn("intake", ["-m", "services.intake"])
            self._wait_ready()
            if s.supervise:
                self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="supervisor")
                self._supervisor.start()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _fleet_env(s: DevStackSettings) -> dict[str, str]:
        """What every service must agree on: engine and model, the block size, the served name, the
        tokenizer intake renders prompts with (the model's own), the context limit."""
        from services.worker.config import model_dir_of, served_model_for

        model_dir = model_dir_of(s.model)
        if model_dir is not None:
            model_dir = model_dir.resolve()
        bs = s.block_size or (32 if s.engine == "vllm" else 16)
        env = {
            "KVMESH_WORKER_ENGINE": s.engine,
            "KVMESH_WORKER_MODEL": str(model_dir) if model_dir is not None else s.model,
            "KVMESH_WORKER_BLOCK_SIZE": str(bs),
            "KVMESH_SCHEDULER_BLOCK_SIZE": str(bs),
            "KVMESH_INTAKE_BLOCK_SIZE": str(bs),
            "KVMESH_KVMANAGER_BLOCK_SIZE": str(bs),
            "KVMESH_INTAKE_MODEL_NAME": served_model_for(s.model),
        }
        if model_dir is not None and (model_dir / "tokenizer.json").is_file():
            env["KVMESH_INTAKE_TOKENIZER_PATH"] = str(model_dir)
        if s.max_context is not None:
            env["KVMESH_WORKER_MAX_CONTEXT"] = str(s.max_context)
            env["KVMESH_INTAKE_MAX_CONTEXT"] = str(s.max_context)
        elif model_dir is not None:
            ctx = _model_context(model_dir)
            if ctx:
                env["KVMESH_INTAKE_MAX_CONTEXT"] = str(ctx)
        return env

    def _metrics_env(self, name: str, prefix: str) -> dict[str, str] | None:
        """The environment of one service with its own metrics port (kept across restarts)."""
        if not self.settings.metrics:
            return None
        from streams.embedded import free_port

        port = free_port()
        self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        return {
            **self._env,
            f"KVMESH_{prefix}_METRICS_HOST": "127.0.0.1",
            f"KVMESH_{prefix}_METRICS_PORT": str(port),
        }

    def status(self) -> dict[str, Any]:
        """``{"services": {name: {"metrics_url", "pid", "ready"}}}``, one entry per process. Ready: the
        process runs and answers (intake: ``/readyz``; the others: their ``/metrics``)."""
        out: dict[str, Any] = {}
        for name, child in sorted(self.children.items()):
            url = self.metrics_urls.get(name)
            probe = f"{self.intake_url}/readyz" if name == "intake" else url
            ready = False
            if child.alive() and probe:
                with contextlib.suppress(httpx.HTTPError):
                    ready = httpx.get(probe, timeout=2.0).status_code == 200
            out[name] = {"metrics_url": url, "pid": child.proc.pid, "ready": ready}
        return {"services": out}

    def write_status(self, path: str | Path) -> dict[str, Any]:
        """Write :meth:`status` as JSON (atomically: a reader never sees half a file)."""
        status = self.status()
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(status, indent=2) + "\n")
        os.replace(tmp, target)
        return status

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, *args]
        self.children[name] = _Child(name, argv, env or self._env, self._sink)

    def _supervise(self) -> None:
        """Restart a service that died, after a backoff that doubles per quick death (a crash loop
        must not spin) and resets once the service has run for a while."""
        delay: dict[str, float] = {}
        dead_since: dict[str, float] = {}
        while not self._stopping.wait(0.2):
            now = time.monotonic()
            with self._lock:
                for name, child in list(self.children.items()):
                    if child.alive():
                        if now - child.started_s > RESTART_RESET_AFTER_S:
                            delay.pop(name, None)
                        continue
                    first = dead_since.setdefault(name, now)
                    wait = delay.get(name, RESTART_FIRST_S)
                    if now - first < wait:
                        continue
                    dead_since.pop(name)
                    delay[name] = min(wait * 2, RESTART_MAX_S)
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    log.warning(
                        "%s exited with %s; restarting it (restart %d, after %.1fs)",
                        name,
                        child.proc.returncode,
                        self.restarts[name],
                        wait,
                    )
                    self._sink(f"[dev] {name} exited with {child.proc.returncode}; restarted")
                    self.children[name] = _Child(name, child.argv, child.env, self._sink)

    def kill_broker(self) -> None:
        """SIGKILL the broker (a crash). In durable mode its data lives on in the object store."""
        assert self.broker is not None
        self.broker.kill()

    def restart_broker(self) -> None:
        """Start the broker again on its port; without durability it comes back empty, so the topics
        are created again (what services had in flight there is gone)."""
        assert self.broker is not None
        from streams.admin import ensure_topics

        self.broker.start()
        asyncio.run(ensure_topics(self.kafka))

    def kill_object_store(self) -> None:
        """SIGKILL the durable broker's object store; its objects stay on disk."""
        assert self.object_store is not None
        self.object_store.kill()

    def restart_object_store(self) -> None:
        assert self.object_store is not None
        self.object_store.start()

    def kill_redis(self) -> None:
        assert self.redis is not None
        self.redis.kill()

    def restart_redis(self) -> None:
        assert self.redis is not None
        self.redis.start()

    def restart_worker(self, worker_id: str) -> None:
        """Start a (killed) worker again under the same id."""
        self.restart(worker_id)

    def set_drain(self, worker_id: str, drain: bool = True, reason: str = "operator") -> None:
        """Drain (or undrain) a worker and return once its LoadReport says so, plus a moment for the
        scheduler, which reads the same topic. A drained worker takes no new requests but keeps
        serving its KV blocks, so its sessions move to other workers by fetching, not recomputing."""
        asyncio.run(self._set_drain(worker_id, drain, reason))

    async def _set_drain(self, worker_id: str, drain: bool, reason: str) -> None:
        from schemas.messages import DrainCommand, LoadReport
        from streams import topics
        from streams.consumer import TypedConsumer
        from streams.producer import TypedProducer

        loads = TypedConsumer(self.kafka, [topics.LOAD], group_id=None, from_beginning=False, dedup=False)
        await loads.start()
        try:
            async with TypedProducer(self.kafka, f"kvmesh-dev-operator-{int(drain)}") as p:
                await p.send(topics.CONTROL, DrainCommand(worker_id=worker_id, drain=drain, reason=reason))
            async with asyncio.timeout(30):
                seen = False
                while not seen:
                    for rec in await loads.getmany(timeout_ms=200):
                        m = rec.message
                        seen = seen or (
                            isinstance(m, LoadReport) and m.worker_id == worker_id and m.draining == drain
                        )
        finally:
            await loads.stop()
        await asyncio.sleep(0.5)

    def kill(self, name: str) -> None:
        """Kill a service process at once (SIGKILL): a crash, for fault tests. With ``supervise``
        the supervisor starts it again."""
        child = self.children[name]
        child.kill()
        child.wait(10)

    def restart(self, name: str) -> None:
        """Start a killed service again (the same command and environment)."""
        with self._lock:
            child = self.children[name]
            if not child.alive():
                self.children[name] = _Child(name, child.argv, child.env, self._sink)

    def _check_children(self) -> None:
        for name, child in self.children.items():
            if not child.alive():
                tail = "\n".join(child.lines[-30:])
                raise RuntimeError(
                    f"service {name} exited with {child.proc.returncode} during start:\n{tail}"
                )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            self._check_children()
            try:
                # ready, not merely alive: the broker takes records and a worker serves the model
                r = httpx.get(f"{self.intake_url}/readyz", timeout=2.0)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("intake did not become ready in time")
            time.sleep(0.2)
        remaining = max(deadline - time.monotonic(), 1.0)
        asyncio.run(self._wait_workers(remaining))

    async def _wait_workers(self, timeout_s: float) -> None:
        """Ready when every worker has published a LoadReport (so the scheduler can route to it)."""
        from schemas.messages import LoadReport
        from streams import topics
        from streams.consumer import TypedConsumer

        seen: set[str] = set()
        consumer = TypedConsumer(self.kafka, [topics.LOAD], group_id=None, from_beginning=True, dedup=False)
        await consumer.start()
        try:
            deadline = time.monotonic() + timeout_s
            while not set(self.worker_ids) <= seen:
                self._check_children()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {sorted(set(self.worker_ids) - seen)} never reported load")
                for rec in await consumer.getmany(timeout_ms=500):
                    if isinstance(rec.message, LoadReport):
                        seen.add(rec.message.worker_id)
        finally:
            await consumer.stop()
        # Give the scheduler a moment to read the same reports before the first request.
        await asyncio.sleep(1.0)

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
            self._supervisor = None
        # Intake first (no new work), workers next (they announce their blocks are gone), the rest last.
        order = [
            "intake",
            *[n for n in self.children if n.startswith("worker-")],
            "scheduler",
            *self.kvmanager_names,
        ]
        try:
            for name in order:
                child = self.children.get(name)
                if child is not None:
                    child.terminate()
            for name in order:
                child = self.children.get(name)
                if child is not None and not child.wait(10):
                    child.kill()
                    child.wait(5)
        finally:
            # whatever interrupted the orderly stop, no service outlives the stack
            for child in self.children.values():
                child.kill()
            self.children.clear()
            for server in (self.redis, self.broker, self.object_store):
                if server is not None:
                    with contextlib.suppress(Exception):
                        server.stop()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None


def _model_context(model_dir: object) -> int | None:
    """``max_position_embeddings`` of a model directory's config.json, if readable."""
    import json
    from pathlib import Path

    try:
        return int(json.loads((Path(str(model_dir)) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
