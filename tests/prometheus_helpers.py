"""A real Prometheus server on loopback, scraping given /metrics URLs, for integration tests.

Runs the ``prometheus`` binary (Debian's package; ``scripts/bootstrap.sh`` installs it) with a
generated config and a temporary TSDB, and talks to its HTTP API::

    with EmbeddedPrometheus({"worker-0": "http://127.0.0.1:9101/metrics"}) as prom:
        prom.targets()  # [{"job": "worker-0", "health": "up", "lastError": ""}]
        prom.query("sum(up)")  # [{"metric": {}, "value": [1700000000.0, "1"]}]

Test modules skip themselves when ``shutil.which("prometheus")`` is None; here a missing binary is
an error.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx

from streams.embedded import _ChildProcess, free_port

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def _yaml_str(value: str) -> str:
    """A double-quoted YAML scalar (JSON string syntax is valid YAML)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_config(jobs: dict[str, str], scrape_interval: str = "1s") -> str:
    """prometheus.yml: one job per entry, its static target and metrics_path taken from the URL."""
    lines = [
        "global:",
        f"  scrape_interval: {scrape_interval}",
        f"  evaluation_interval: {scrape_interval}",
        "scrape_configs:",
    ]
    for job, url in jobs.items():
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"metrics URL for job {job!r} needs scheme, host and port: {url!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        lines += [
            f"  - job_name: {_yaml_str(job)}",
            f"    scheme: {parts.scheme}",
            f"    metrics_path: {_yaml_str(parts.path or '/metrics')}",
            "    static_configs:",
            f"      - targets: [{_yaml_str(f'{host}:{parts.port}')}]",
        ]
    return "\n".join(lines) + "\n"


class EmbeddedPrometheus:
    """``prometheus`` on 127.0.0.1:<free port>. ``start()``/``stop()`` are safe twice; a context manager.

    The process, its log file and its readiness wait are the dev stack's own
    (:class:`streams.embedded._ChildProcess`), as for the broker and Redis.
    """

    def __init__(self, jobs: dict[str, str], binary: str = "prometheus", scrape_interval: str = "1s") -> None:
        if not jobs:
            raise ValueError("EmbeddedPrometheus needs at least one job")
        self.jobs = dict(jobs)
        self.binary = binary
        self.scrape_interval = scrape_interval
        self.port: int | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._child = _ChildProcess("prometheus")
        self._client: httpx.Client | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedPrometheus is not started")
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return self._child.log_tail(lines) or "(no log)"

    def start(self) -> EmbeddedPrometheus:
        if self._child.alive():
            return self
        exe = shutil.which(self.binary)
        if exe is None:
            raise RuntimeError(
                f"{self.binary!r} is not on PATH: install the Debian package `prometheus` "
                "(scripts/bootstrap.sh does)"
            )
        config_text = render_config(self.jobs, self.scrape_interval)
        self._tmp = tempfile.TemporaryDirectory(prefix="kvmesh-prometheus-")
        try:
            root = Path(self._tmp.name)
            config = root / "prometheus.yml"
            config.write_text(config_text)
            (root / "data").mkdir()
            self.port = free_port()
            self._child.spawn(
                [
                    exe,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ]
            )
            self._client = httpx.Client(base_url=self.url, timeout=5.0)
            self._child.wait_ready(self._ready, READY_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self._client is not None
        try:
            return self._client.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._child.stop(grace_s=STOP_TIMEOUT_S)
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedPrometheus:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _api(self, path: str, params: dict[str, str] | None = None) -> Any:
        if self._client is None:
            raise RuntimeError("EmbeddedPrometheus is not started")
        r = self._client.get(path, params=params)
        try:
            body = r.json()
        except ValueError:
            r.raise_for_status()
            raise RuntimeError(f"prometheus {path}: not JSON: {r.text[:200]!r}") from None
        if body.get("status") != "success":
            raise RuntimeError(
                f"prometheus {path} {params or ''}: {body.get('errorType')}: {body.get('error')} "
                f"(HTTP {r.status_code})"
            )
        return body["data"]

    def targets(self) -> list[dict[str, str]]:
        """The active targets: ``[{"job", "health" ("up"/"down"/"unknown"), "lastError"}]``."""
        data = self._api("/api/v1/targets", {"state": "active"})
        return [
            {
                "job": t.get("labels", {}).get("job") or t.get("scrapePool", ""),
                "health": t.get("health", ""),
                "lastError": t.get("lastError", ""),
            }
            for t in data.get("activeTargets", [])
        ]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; the result list (for a vector ``[{"metric": {...}, "value": [t, "v"]}]``).

        A scalar or string result comes back as one entry ``{"metric": {}, "value": [t, "v"]}``.
        """
        data = self._api("/api/v1/query", {"query": promql})
        result = data.get("result", [])
        if data.get("resultType") in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return list(result)
