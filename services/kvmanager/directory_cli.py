"""``kvmesh directory``: who holds a prefix, cache usage per worker and tier, fleet hit/miss counters.

A prefix is given as block hashes (``--hashes``) or as a prompt (``--prompt`` with ``--tenant``),
rendered with the shared chat template and hashed exactly as intake does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvmesh_core.tokenizer import ChatMessage, load_tokenizer, render_chat
from schemas.blocks import DEFAULT_BLOCK_SIZE, block_hashes, tenant_namespace
from services.fleet_directory.layout import STATS_KEY
from services.fleet_directory.snapshot import DirectorySnapshot, read_snapshot
from services.kvmanager.config import KvManagerSettings
from streams.settings import RedisSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh directory", description=__doc__)
    p.add_argument("--redis", help="Redis URL (default: KVMESH_KVMANAGER_REDIS__URL)")
    p.add_argument("--hashes", help="comma-separated block hashes of a prefix (decimal or 0x hex)")
    p.add_argument("--prompt", help="a user message; its prompt blocks are looked up")
    p.add_argument("--system", help="an optional system message before the prompt")
    p.add_argument("--tenant", default="default")
    p.add_argument("--public-prefix-tokens", type=int, default=0)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--tokenizer", help="path of a local tokenizer.json (default: byte tokenizer)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


def prefix_hashes(args: argparse.Namespace) -> list[int]:
    if args.hashes:
        return [int(h, 0) for h in args.hashes.split(",") if h.strip()]
    if args.prompt is None:
        return []
    messages = ([ChatMessage("system", args.system)] if args.system else []) + [
        ChatMessage("user", args.prompt)
    ]
    tokens = render_chat(load_tokenizer(args.tokenizer), messages)
    return block_hashes(tokens, args.block_size, tenant_namespace(args.tenant), args.public_prefix_tokens)


def report(snap: DirectorySnapshot, stats: dict[str, int], prefix: list[int]) -> dict[str, Any]:
    """The CLI's whole answer as plain data (also what ``--json`` prints)."""
    usage: dict[str, dict[str, int]] = {w: {} for w in snap.workers}
    for holders in snap.blocks.values():
        for w, tier in holders.items():
            per = usage.setdefault(w, {})
            per[tier] = per.get(tier, 0) + 1
    blocks = [{"index": i, "hash": h, "holders": snap.blocks.get(h, {})} for i, h in enumerate(prefix)]
    # Per worker: how many leading blocks of the prefix it holds (what a request could reuse there).
    longest: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(prefix):
        here = set(snap.blocks.get(h, {}))
        alive = here if alive is None else alive & here
        for w in alive:
            longest[w] = i + 1
    lookups = stats.get("lookups", 0)
    hit, miss = stats.get("hit_blocks", 0), stats.get("miss_blocks", 0)
    return {
        "prefix": blocks,
        "leading_blocks_held": dict(sorted(longest.items())),
        "workers": {
            w: {"blocks_by_tier": dict(sorted(usage.get(w, {}).items())), "info": snap.workers.get(w, {})}
            for w in sorted(usage)
        },
        "total_blocks": len(snap.blocks),
        "stats": {**stats, "lookups": lookups, "hit_rate": hit / (hit + miss) if hit + miss else 0.0},
    }


def render_text(rep: dict[str, Any]) -> str:
    lines = []
    if rep["prefix"]:
        lines.append("prefix blocks:")
        for b in rep["prefix"]:
            held = ", ".join(f"{w}={t}" for w, t in sorted(b["holders"].items())) or "-"
            lines.append(f"  [{b['index']:3d}] {b['hash']:#018x}  {held}")
        lines.append(
            "leading blocks held: "
            + (", ".join(f"{w}={n}" for w, n in rep["leading_blocks_held"].items()) or "none")
        )
    lines.append(f"workers ({rep['total_blocks']} distinct blocks in the fleet):")
    for w, info in rep["workers"].items():
        tiers = " ".join(f"{t}={n}" for t, n in info["blocks_by_tier"].items()) or "no blocks"
        lines.append(f"  {w:<16} {tiers}  last_seen_ms={info['info'].get('last_seen_ms', '?')}")
    s = rep["stats"]
    lines.append(
        f"lookups={s['lookups']} hit_blocks={s.get('hit_blocks', 0)} miss_blocks={s.get('miss_blocks', 0)} "
        f"hit_rate={s['hit_rate']:.3f}"
    )
    return "\n".join(lines) + "\n"


async def collect(redis: RedisSettings, prefix: list[int]) -> dict[str, Any]:
    # The settings' password and timeouts apply to a --redis URL too (a rediss:// directory needs auth).
    client = redis.connect()
    try:
        snap = await read_snapshot(client)
        raw = await client.hgetall(STATS_KEY)
    finally:
        await client.aclose()
    stats = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
    return report(snap, stats, prefix)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    redis = KvManagerSettings().redis
    if args.redis:
        redis = redis.model_copy(update={"url": args.redis})
    rep = asyncio.run(collect(redis, prefix_hashes(args)))
    sys.stdout.write(json.dumps(rep, sort_keys=True) + "\n" if args.json else render_text(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
