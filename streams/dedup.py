"""Duplicate detection by producer sequence: the high-water seq per (topic, partition, producer).

A producer's seq grows by one per record over all the partitions it writes, so it is monotonic only
*within* a partition; the high-water mark is therefore kept per partition, never per producer alone::

    partition 0:  p1#10  p1#12  p1#12(dup)  p1#15
    partition 1:  p1#11  p1#13  p1#14
"""

from __future__ import annotations


class SeqDeduplicator:
    """Owns the map (topic, partition, producer) -> highest seq handled.

    Invariant: a mark only moves up. ``is_duplicate`` never changes state; ``mark`` is called once the
    record has been handled, so a record whose handler failed is not taken for a duplicate later.
    """

    def __init__(self) -> None:
        self._high: dict[tuple[str, int, str], int] = {}

    def is_duplicate(self, topic: str, partition: int, producer: str, seq: int) -> bool:
        high = self._high.get((topic, partition, producer))
        return high is not None and seq <= high

    def mark(self, topic: str, partition: int, producer: str, seq: int) -> None:
        k = (topic, partition, producer)
        if seq > self._high.get(k, -1):
            self._high[k] = seq

    def high_water(self, topic: str, partition: int, producer: str) -> int | None:
        return self._high.get((topic, partition, producer))

    def forget_partition(self, topic: str, partition: int) -> None:
        """Drop the marks of a partition (e.g. when a rebalance takes it away)."""
        for k in [k for k in self._high if k[0] == topic and k[1] == partition]:
            del self._high[k]

    def __len__(self) -> int:
        return len(self._high)
