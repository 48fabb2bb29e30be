"""The directory's Redis layout, shared by its one writer (the KV manager) and its readers (a cold-
starting scheduler, ``kvmesh directory``): key names, value encodings and the flush script.

Redis layout (block hashes and offsets as decimal strings). The directory is one or more *slices*,
each the same set of keys under its own prefix and hash tag:

- one manager (the default): the fleet slice ``{kvm}:`` holds everything;
- KV-manager replicas (``sharded``): the fleet slice holds the workers, the load and request offsets
  and the stats, written by the elected leader; each kv-events partition ``p`` has a shard slice
  ``{kvm.p<p>}:`` with the holders, worker sets, offsets and seqs of what that partition said,
  written by the replica that owns the partition. Workers key their kv-events, so one worker's blocks
  live in one shard. Readers merge the slices (``snapshot.read_merged``).

Each slice lives in one Redis Cluster slot: a flush is one atomic script call on one node, and a
reader's MULTI/EXEC of one slice works there as on a plain Redis; shards spread over the masters.
The directory takes about 270 bytes of Redis memory per block held by one worker (10^7 blocks: under
3 GB). Keys of the directory layout before the hash tag (``kvm:holders``, ...) are renamed once, at the
manager's first start on them.

Keys of one slice (prefix ``{kvm}:`` shown):

=========================  ======  ==================================================================
key                        type    content
=========================  ======  ==================================================================
``{kvm}:holders``          hash    block hash → ``"{parent}|{worker}={tier}:{last_ms},…"`` (entries by
                                   worker id; ``{parent}|`` absent when no event named the parent;
                                   parent 0 for a first block)
``{kvm}:wrk:{worker}``     set     block hashes the worker holds
``{kvm}:workers``          hash    worker → JSON info (last_seen_ms, transfer_address, tiers, …)
``{kvm}:offsets``          hash    ``"{topic}:{partition}"`` → next offset to consume
``{kvm}:seqs``             hash    ``"{topic}:{partition}:{producer}"`` → last applied envelope seq
``{kvm}:stats``            hash    counters (lookups, hit_blocks, miss_blocks, events, blocks_applied)
``{kvm}:version``          string  incremented by every flush (readers WATCH it for a consistent read)
=========================  ======  ==================================================================

"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: Every directory key starts with this: the hash tag puts them all in one Redis Cluster slot.
KEY_PREFIX = "{kvm}:"
HOLDERS_KEY = KEY_PREFIX + "holders"
WORKER_PREFIX = KEY_PREFIX + "wrk:"
WORKERS_KEY = KEY_PREFIX + "workers"
OFFSETS_KEY = KEY_PREFIX + "offsets"
SEQS_KEY = KEY_PREFIX + "seqs"
STATS_KEY = KEY_PREFIX + "stats"
VERSION_KEY = KEY_PREFIX + "version"
#: The directory's keys before the hash tag (renamed by :func:`migrate_legacy_keys`).
LEGACY_PREFIX = "kvm:"
#: Every shard slice's version key matches this (how readers find the slices; see shard_prefix).
SHARD_VERSION_MATCH = "{kvm.p*}:version"
#: The KV-manager replicas' leader lease (``SET NX PX``): outside every slice's key space, so no
#: slice's whole rewrite unlinks it.
LEASE_KEY = "{kvm.lease}:kvmanager"


def shard_prefix(partition: int) -> str:
    """The key prefix of the slice that holds what kv-events partition ``partition`` says (replicas).

    Its own hash tag, so on a Redis Cluster the slices spread over the masters and each flush
    touches one slot.
    """
    return f"{{kvm.p{partition}}}:"


def shard_of_prefix(prefix: str) -> int | None:
    """The partition of a shard slice prefix; None for the fleet slice (:data:`KEY_PREFIX`)."""
    if prefix.startswith("{kvm.p") and prefix.endswith("}:"):
        return int(prefix[len("{kvm.p") : -2])
    return None


#: Applies one flush atomically inside Redis. ARGV[1] is a MessagePack map of flat lists (see
#: ``DirectoryWriter._payload``), ARGV[2] the slice's key prefix (:data:`KEY_PREFIX` or a
#: :func:`shard_prefix`), ARGV[3] the version the writer expects to find ('' = no check). KEYS[1] is the
#: slice's version key, named so that a cluster client routes the call to the node of the slice's slot
#: (every key the script touches has the same hash tag). One call replaces tens of thousands of
#: pipelined commands, whose client-side encoding and reply parsing would otherwise dominate the
#: manager's time.
#:
#: Fencing: with an expected version, a slice whose version differs is not written; the script
#: returns ``-1 - current`` instead (a replica that lost a shard to another must not overwrite it).
APPLY_LUA = """
if ARGV[3] ~= '' then
  local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
  if cur ~= tonumber(ARGV[3]) then return -1 - cur end
end
local p = cmsgpack.unpack(ARGV[1])
local P = ARGV[2]
local STEP = 1000
local function chunked(cmd, key, list, width)
  local n = #list
  local i = 1
  while i <= n do
    local j = math.min(i + STEP * width - 1, n)
    redis.call(cmd, key, unpack(list, i, j))
    i = j + 1
  end
end
local function each_key(cmd, list)
  local i = 1
  while i <= #list do
    local j = math.min(i + STEP - 1, #list)
    redis.call(cmd, unpack(list, i, j))
    i = j + 1
  end
end
each_key('UNLINK', p.unlink)
chunked('HSET', P .. 'holders', p.hs, 2)
chunked('HDEL', P .. 'holders', p.hd, 1)
for _, w in ipairs(p.wx) do redis.call('DEL', P .. 'wrk:' .. w) end
for w, m in pairs(p.wa) do chunked('SADD', P .. 'wrk:' .. w, m, 1) end
for w, m in pairs(p.wr) do chunked('SREM', P .. 'wrk:' .. w, m, 1) end
chunked('HSET', P .. 'workers', p['is'], 2)
chunked('HDEL', P .. 'workers', p.id, 1)
chunked('HSET', P .. 'offsets', p.os, 2)
chunked('HSET', P .. 'seqs', p.ss, 2)
chunked('HSET', P .. 'stats', p.st, 2)
return redis.call('INCR', KEYS[1])
"""

#: Errors that mean "Redis is not reachable right now" (as opposed to a bug in a command).
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


async def migrate_legacy_keys(client: Any) -> int:
    """Rename the keys of the directory layout before the hash tag (``kvm:*``) to the tagged ones,
    unless a tagged directory exists already; returns how many were renamed. On a plain Redis (a
    cluster never held the old layout: its flush script could not run there)."""
    if await client.exists(VERSION_KEY):
        return 0
    old = [
        k.decode() if isinstance(k, bytes) else k async for k in client.scan_iter(match="kvm:*", count=1000)
    ]
    for key in old:
        await client.rename(key, KEY_PREFIX + key[len(LEGACY_PREFIX) :])
    return len(old)


def worker_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}"


def encode_holders(holders: dict[str, tuple[str, int]]) -> str:
    """``{"w1": ("gpu", 5)}`` → ``"w1=gpu:5"`` (entries by worker id, joined by commas)."""
    if len(holders) == 1:  # the common case, without the sort
        for w, (t, ms) in holders.items():
            return f"{w}={t}:{ms}"
    return ",".join(f"{w}={t}:{ms}" for w, (t, ms) in sorted(holders.items()))


def split_holders_value(value: str) -> tuple[int | None, str]:
    """A ``{kvm}:holders`` value → (parent hash or None, the entries part)."""
    parent, sep, entries = value.partition("|")
    if not sep:
        return None, value
    return int(parent), entries


def count_holders(value: str) -> int:
    """The number of workers in a ``{kvm}:holders`` value (0 for an empty one)."""
    entries = value.rpartition("|")[2]
    return entries.count(",") + 1 if entries else 0


def decode_holders(value: str) -> dict[str, tuple[str, int]]:
    """The entries of a ``{kvm}:holders`` value (its parent prefix, if any, is skipped)."""
    out: dict[str, tuple[str, int]] = {}
    for entry in value.rpartition("|")[2].split(","):
        if not entry:
            continue
        w, _, rest = entry.partition("=")
        tier, _, last = rest.partition(":")
        out[w] = (tier, int(last or 0))
    return out


def valid_worker_id(worker_id: str) -> bool:
    return bool(worker_id) and not any(c in worker_id for c in ",=:|")
