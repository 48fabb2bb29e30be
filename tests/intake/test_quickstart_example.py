"""examples/quickstart.py, the README's producer-SDK quickstart, run as a user runs it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from conftest import ECHO_WORKER, EchoWorker

from kvmesh_core.tokenizer import ByteTokenizer
from streams.settings import KafkaSettings

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


async def test_the_quickstart_publishes_a_multi_turn_chat_and_streams_each_reply(
    kafka_settings: KafkaSettings, echo_worker: EchoWorker
) -> None:
    env = {
        **os.environ,
        "KVMESH_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
        "KVMESH_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, err.decode()[-2000:]
    # each reply streamed (the echo worker answers "echo:" + the last user message, 24 tokens at most)
    assert "turn 1 < echo:What is a KV cache?" in text
    assert "turn 3 < echo:And what happens wh\n" in text  # cut at max_tokens=24
    assert text.count(f"worker={ECHO_WORKER}") == 3
    # one session; every turn re-sends the whole history, so each prompt extends the one before
    reqs = echo_worker.requests
    assert len(reqs) == 3 and len({r.session_id for r in reqs}) == 1
    prompts = [ByteTokenizer().decode(r.token_ids) for r in reqs]
    asked = ["What is a KV cache?", "Why does a multi-turn chat", "And what happens when"]
    for turn, prompt in enumerate(prompts):
        assert all(q in prompt for q in asked[: turn + 1])
    assert "echo:What is a KV cache?" in prompts[1] and "echo:Why does a multi-tu" in prompts[2]
