"""``kvmesh dev`` as an operator runs it: up on loopback, answers, and one Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    from streams.embedded import free_port

    return free_port()


def _descendants(pid: int) -> set[int]:
    """Every live process whose ancestry reaches ``pid`` (services start sessions of their own)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(entry)] = int(fields[1])
            except OSError:
                continue
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - out
        out |= frontier
    return out


def test_dev_comes_up_answers_and_one_ctrl_c_stops_every_process() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "dev", "--workers", "1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        for line in proc.stderr:
            if "kvmesh dev is ready" in line:
                break
            assert time.monotonic() < deadline, "kvmesh dev did not come up"
        assert f"127.0.0.1:{port}" in line
        # keep reading: the relayed service logs must never fill the pipe and stall the dev process
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
        children = _descendants(proc.pid)
        assert len(children) >= 6  # tansu, redis-server, kvmanager, scheduler, worker, intake
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=60,
            json={"model": "kvmesh-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()
        assert ready["status"] == "ready" and ready["live_workers"] == 1 and ready["live_schedulers"] == 1
        # supervised: a service killed outright is started again, and the fleet answers again
        victim = _service_pid(children, "services.kvmanager")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _service_pid(_descendants(proc.pid), "services.kvmanager") in (None, victim):
            assert time.monotonic() < deadline, "the killed kvmanager was not restarted"
            time.sleep(0.2)
        children = _descendants(proc.pid)
        # Ctrl-C in a terminal: SIGINT to the foreground process group
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        still = [pid for pid in children if os.path.exists(f"/proc/{pid}") and _alive(pid)]
        assert not still, f"processes outlived kvmesh dev: {still}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _service_pid(pids: set[int], module: str) -> int | None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if module.encode() in f.read() and _alive(pid):
                    return pid
        except OSError:
            continue
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
