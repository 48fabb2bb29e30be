"""``kvmesh dev --durable``: the broker (tansu), its object store (streams.local_s3, on disk) and Redis
(AOF) are SIGKILLed and restarted under a running fleet, and nothing is lost.

Before the broker dies a conversation builds KV blocks; while it is down intake answers fast JSON
503s (the SDK retries them); after it is back every topic, record and committed offset is still
there: no request is run twice, the conversation goes on, and the directory still lists its blocks.
A killed Redis comes back from its append-only file with the same directory. A service killed under
supervision is restarted by the stack.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import openai
import pytest
from fleet_helpers import read_topic

from kvmesh.devstack import DevStack, DevStackSettings
from schemas.messages import ChatRequest, Completion
from services.kvmanager.directory_cli import collect
from streams import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "kvmesh-tiny"


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    logs: list[str] = []
    settings = DevStackSettings(
        workers=1, intake_port=0, gpu_blocks=256, dram_blocks=256, durable=True, supervise=True
    )
    with DevStack(settings, sink=logs.append) as s:
        yield s


def _ask(client: openai.OpenAI, history: list[dict[str, str]], text: str) -> str:
    history.append({"role": "user", "content": text})
    r = client.chat.completions.create(
        model=MODEL,
        messages=history,
        max_tokens=8,
        temperature=0,
        user="durable-alice",  # type: ignore[arg-type]
    )
    answer = r.choices[0].message.content or ""
    history.append({"role": "assistant", "content": answer})
    return answer


def _eventually(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def _directory(stack: DevStack) -> dict:
    return asyncio.run(collect(stack.redis_settings, []))


def test_broker_and_redis_crash_and_restart_lose_nothing(stack: DevStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.intake_url}/v1", api_key="x", max_retries=8, timeout=60)
    history: list[dict[str, str]] = [{"role": "system", "content": "You keep the fleet's cache. " * 8}]
    for turn in range(2):
        _ask(client, history, f"turn {turn}: what is cached?")
    before = _directory(stack)
    assert before["total_blocks"] > 0
    sent_before = [m for m in read_topic(stack.kafka, topics.REQUESTS, 1.0) if isinstance(m, ChatRequest)]

    # The broker and its object store both die: the objects are on disk, so neither loses a record.
    stack.kill_broker()
    stack.kill_object_store()
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as down:
        openai.OpenAI(
            base_url=f"{stack.intake_url}/v1", api_key="x", max_retries=0, timeout=30
        ).chat.completions.create(model=MODEL, messages=history, max_tokens=4)  # type: ignore[arg-type]
    assert down.value.status_code == 503 and time.monotonic() - t0 < 15
    stack.restart_object_store()
    stack.restart_broker()

    # the records written before the crash are all still there
    want = {m.request_id for m in sent_before}
    _eventually(
        lambda: (
            want
            <= {
                m.request_id
                for m in read_topic(stack.kafka, topics.REQUESTS, 2.0)
                if isinstance(m, ChatRequest)
            }
        ),
        "records written before the crash are missing",
    )
    # the conversation goes on (the SDK retries the 503s while the fleet reconnects)
    for turn in range(2, 4):
        _ask(client, history, f"turn {turn}: and now?")
    done = [m for m in read_topic(stack.kafka, topics.REPLIES, 1.0) if isinstance(m, Completion)]
    ids = [c.request_id for c in done if c.finish_reason in ("stop", "length")]
    assert len(ids) == len(set(ids)), "a request was answered twice"
    assert len(ids) >= 4

    # Redis: SIGKILL, restart from its append-only file: the directory is what it was
    # workers that went unheard while the broker was down are re-announced: the directory heals
    _eventually(
        lambda: _directory(stack)["total_blocks"] >= before["total_blocks"], "the directory did not heal"
    )
    held = _directory(stack)
    time.sleep(1.5)  # appendfsync everysec: what was written a second ago is on disk
    stack.kill_redis()
    stack.restart_redis()
    again = _directory(stack)
    assert again["total_blocks"] == held["total_blocks"]
    assert again["workers"].keys() == held["workers"].keys()


def test_a_killed_service_is_restarted_by_the_supervisor(stack: DevStack) -> None:
    stack.kill("scheduler")
    deadline = time.monotonic() + 30
    while stack.restarts.get("scheduler", 0) < 1 or not stack.children["scheduler"].alive():
        assert time.monotonic() < deadline, "the scheduler was not restarted"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{stack.intake_url}/v1", api_key="x", max_retries=8, timeout=60)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
