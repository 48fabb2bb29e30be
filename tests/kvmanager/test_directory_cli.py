"""``kvmesh directory`` against a real Redis holding a small directory."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from kvmesh_core.tokenizer import ByteTokenizer, ChatMessage, render_chat
from schemas.blocks import block_hashes, tenant_namespace
from services.kvmanager import directory_cli
from services.kvmanager.directory import Directory

from .helpers import load, request, stored, w

pytestmark = pytest.mark.integration

PROMPT = "tell me about paged attention and block tables, in some detail please"


def prompt_hashes() -> list[int]:
    tokens = render_chat(ByteTokenizer(), [ChatMessage("user", PROMPT)])
    return block_hashes(tokens, 16, tenant_namespace("acme"))


def populate(url: str) -> None:
    async def go() -> None:
        hashes = prompt_hashes()
        d = Directory()
        d.apply_load(load("w1", 100))
        d.apply_load(load("w2", 100))
        d.apply_kv_event(stored("w1", hashes))
        d.apply_kv_event(stored("w2", hashes[:2], tier="dram"))
        d.observe_lookup(request("s", "r", [*hashes, 5], ms=100))
        client = aioredis.from_url(url)
        await w(d).flush(client)
        await client.aclose()

    asyncio.run(go())


def test_prompt_lookup_json(redis_settings, capsys) -> None:
    populate(redis_settings.url)
    hashes = prompt_hashes()
    assert len(hashes) == 4
    rc = directory_cli.main(["--redis", redis_settings.url, "--prompt", PROMPT, "--tenant", "acme", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [b["hash"] for b in out["prefix"]] == hashes
    assert out["prefix"][1]["holders"] == {"w1": "gpu", "w2": "dram"}
    assert out["prefix"][3]["holders"] == {"w1": "gpu"}
    assert out["leading_blocks_held"] == {"w1": 4, "w2": 2}
    assert out["workers"]["w1"]["blocks_by_tier"] == {"gpu": 4}
    assert out["workers"]["w2"]["blocks_by_tier"] == {"dram": 2}
    assert out["stats"]["hit_blocks"] == 4 and out["stats"]["miss_blocks"] == 1
    assert out["stats"]["hit_rate"] == pytest.approx(0.8)


def test_other_tenant_sees_nothing_and_text_output(redis_settings, capsys) -> None:
    populate(redis_settings.url)
    directory_cli.main(["--redis", redis_settings.url, "--prompt", PROMPT, "--tenant", "other", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["leading_blocks_held"] == {} and all(not b["holders"] for b in out["prefix"])
    h = prompt_hashes()
    directory_cli.main(["--redis", redis_settings.url, "--hashes", f"{h[0]},{h[1]:#x}"])
    text = capsys.readouterr().out
    assert "w1=gpu, w2=dram" in text and "leading blocks held: w1=2, w2=2" in text
