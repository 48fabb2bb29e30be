"""The shard slices of the directory that one KV-manager replica owns, and views across shards.

A replica owns the kv-events partitions its consumer group gives it; partition ``p``'s events go
into shard ``p``: a :class:`~services.kvmanager.directory.Directory` with a fenced writer of the
slice ``{kvm.p<p>}:``. Workers key their kv-events, so each worker's blocks are in one shard, and
what placement asks *per worker* (which workers hold a leading run; retain hints) is answered
exactly by the union of the shards::

    OwnedShards ─ holders(h) = ∪ shard.holders(h) over owned shards      (retain hints: exact)
    CombinedView ─ owned ∪ holders fetched from the other shards' slices  (the leader's replication)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.fleet_directory.layout import decode_holders, shard_prefix
from services.kvmanager.directory import Directory
from services.kvmanager.write_behind import DirectoryWriter


def run_holders(holders: Callable[[int], dict[str, str]], block_hashes: Iterable[int]) -> set[str]:
    """Workers that hold every block of ``block_hashes``, given each block's holders."""
    common: set[str] | None = None
    for h in block_hashes:
        here = set(holders(h))
        common = here if common is None else common & here
        if not common:
            return set()
    return common or set()


@dataclass(slots=True)
class Shard:
    partition: int
    directory: Directory
    writer: DirectoryWriter

    @classmethod
    def new(cls, partition: int) -> Shard:
        d = Directory()
        return cls(partition, d, DirectoryWriter(d, shard_prefix(partition), fenced=True))


class OwnedShards:
    """The shards this replica owns, by partition; a placement ``BlockView`` over their union."""

    def __init__(self) -> None:
        self.by_partition: dict[int, Shard] = {}

    def __iter__(self) -> Iterator[Shard]:
        return iter(list(self.by_partition.values()))

    def __contains__(self, partition: int) -> bool:
        return partition in self.by_partition

    def get(self, partition: int) -> Shard | None:
        return self.by_partition.get(partition)

    def add(self, shard: Shard) -> None:
        self.by_partition[shard.partition] = shard

    def pop(self, partition: int) -> Shard | None:
        return self.by_partition.pop(partition, None)

    def partitions(self) -> list[int]:
        return sorted(self.by_partition)

    def block_count(self) -> int:
        """Distinct (block, shard) entries: a block held in two shards counts twice."""
        return sum(len(s.directory.blocks) for s in self.by_partition.values())

    def dirty_size(self) -> int:
        return sum(s.directory.dirty_size() for s in self.by_partition.values())

    def drop_worker_blocks(self, worker_id: str) -> int:
        return sum(
            s.directory.drop_worker_blocks(worker_id)
            for s in self.by_partition.values()
            if worker_id in s.directory.worker_blocks
        )

    # ---- BlockView -------------------------------------------------------------------------------

    def holders(self, block_hash: int) -> dict[str, str]:
        out: dict[str, str] = {}
        for s in self.by_partition.values():
            for w, tier, _ in s.directory.blocks.get(block_hash, ()):
                out[w] = tier
        return out

    def copies(self, block_hash: int) -> int:
        return len(self.holders(block_hash))

    def holders_of_run(self, block_hashes: Iterable[int]) -> set[str]:
        return run_holders(self.holders, block_hashes)


async def fetch_holders(
    client: aioredis.Redis, prefixes: Sequence[str], block_hashes: Sequence[int]
) -> dict[int, dict[str, str]]:
    """The holders of ``block_hashes`` in the given slices, united: one HMGET per slice."""
    out: dict[int, dict[str, str]] = {}
    if not block_hashes:
        return out
    fields = [str(h) for h in block_hashes]
    for prefix in prefixes:
        values = await client.hmget(prefix + "holders", fields)
        for h, value in zip(block_hashes, values, strict=True):
            if value is None:
                continue
            text = value.decode() if isinstance(value, bytes) else str(value)
            here = out.setdefault(h, {})
            for w, (tier, _) in decode_holders(text).items():
                here[w] = tier
    return out


class CombinedView:
    """The owned shards (current) united with holders fetched from the other shards (as of the last
    fetch; the leader refreshes them every ``placement_view_ms``)."""

    def __init__(self, owned: OwnedShards, remote: dict[int, dict[str, str]]) -> None:
        self.owned = owned
        self.remote = remote

    def holders(self, block_hash: int) -> dict[str, str]:
        here = self.owned.holders(block_hash)
        there = self.remote.get(block_hash)
        if there:
            here = {**there, **here}
        return here

    def copies(self, block_hash: int) -> int:
        return len(self.holders(block_hash))

    def holders_of_run(self, block_hashes: Iterable[int]) -> set[str]:
        return run_holders(self.holders, block_hashes)
