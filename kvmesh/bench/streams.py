"""``kvmesh bench streams``: the typed streams layer against raw aiokafka, in one run on one broker.

Measured in ``--rounds`` alternating rounds (raw, typed, typed, raw, ...) so that a noisy machine hurts
both alike; the reported msgs/s are the medians of the rounds. Every measurement gets a fresh client on
a fresh topic (a new ``topic_prefix``), warmed up before the clock starts: the embedded broker keeps
topics in memory and slows as one grows, which would otherwise favour whoever measures first.

* throughput: publish ``--messages`` ChatRequests (``--tokens`` prompt tokens each) as fast as the
  producer takes them while a consumer reads them; msgs/s = messages / (first send .. last receive);
* latency: publish ``--latency-messages`` at ``--rate`` msgs/s; per message, send-to-receive time.

Both sides do the same Kafka work: the same producer and consumer settings, batch sizes and message
count, and each record is queued without awaiting its delivery. "raw" sends the same messages'
records, encoded before the clock starts, through AIOKafkaProducer and counts what AIOKafkaConsumer
returns; "typed" sends the messages through TypedProducer.send (envelope, seq, encode) and reads
them with TypedConsumer.getmany (strict decode and validation of every record, dedup). The messages
are built before the clock starts on both sides. The ratio is the cost of the typed layer;
``encode_us`` / ``decode_us`` are the codec's share of it, per message, timed in-process, and
``*_cpu_us_per_msg`` this process's CPU per message on each side (steadier than msgs/s on a busy box).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from tqdm import tqdm

from kvmesh.percentiles import percentile
from kvmesh_core.runtime import GC_GEN0_THRESHOLD, tune_gc
from schemas.blocks import block_hashes
from schemas.codec import decode, encode
from schemas.messages import ChatRequest
from streams.admin import ensure_topics, topic_name
from streams.consumer import TypedConsumer, consumer_options
from streams.embedded import EmbeddedBroker
from streams.producer import TypedProducer, producer_options
from streams.settings import KafkaSettings
from streams.topics import REQUESTS

BLOCK = 16
#: Records per consumer fetch, on both sides.
MAX_BATCH = 2000


def _request(i: int, tokens: list[int], hashes: list[int]) -> ChatRequest:
    return ChatRequest(
        request_id=f"r{i}",
        session_id=f"s{i % 64}",
        tenant="bench",
        token_ids=tokens,
        block_hashes=hashes,
        block_size=BLOCK,
        max_tokens=64,
        arrival_ms=1_700_000_000_000 + i,
    )


class _Client:
    """One side of the comparison: how to send message i and how to read a batch of records."""

    def __init__(self, kafka: KafkaSettings, typed: bool, messages: list[ChatRequest]) -> None:
        self.kafka = kafka
        self.typed = typed
        self.messages = messages
        # raw sends the same records, encoded before the clock starts: distinct bytes per message as a
        # real producer's would be (one bytes object sent 5000 times would stay in the CPU cache)
        self._raw_values = [encode(m, "bench-raw", i, 0) for i, m in enumerate(messages)] if not typed else []
        self._raw_keys = [m.session_id.encode() for m in messages]
        self._name = topic_name(REQUESTS, kafka)
        self._tp: TypedProducer | None = None
        self._tc: TypedConsumer | None = None
        self._rp: AIOKafkaProducer | None = None
        self._rc: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        if self.typed:
            self._tp = TypedProducer(self.kafka, "bench-typed")
            await self._tp.start()
            self._tc = TypedConsumer(self.kafka, [REQUESTS], from_beginning=True, max_batch=MAX_BATCH)
            await self._tc.start()
        else:
            # The settings TypedProducer and TypedConsumer use, so only the typed layer differs.
            self._rp = AIOKafkaProducer(**self.kafka.client_kwargs(), **producer_options(self.kafka))
            await self._rp.start()
            self._rc = AIOKafkaConsumer(
                **self.kafka.client_kwargs(),
                **consumer_options(self.kafka, group_id=None, from_beginning=True),
            )
            await self._rc.start()
            self._rc.assign([TopicPartition(self._name, p) for p in range(REQUESTS.partitions)])

    async def stop(self) -> None:
        for c in (self._tp, self._tc, self._rp, self._rc):
            if c is not None:
                await c.stop()

    async def send(self, i: int) -> Awaitable[Any]:
        """Queue message ``i`` (modulo the prepared ones); returns its delivery future, not awaited."""
        i %= len(self.messages)
        if self._tp is not None:
            result: Awaitable[Any] = await self._tp.send(REQUESTS, self.messages[i], wait=False)
            return result
        assert self._rp is not None
        # Bytes encoded beforehand: raw pays for no encoding or validation.
        result = await self._rp.send(self._name, self._raw_values[i], key=self._raw_keys[i])
        return result

    async def flush(self) -> None:
        if self._tp is not None:
            await self._tp.flush()
        elif self._rp is not None:
            await self._rp.flush()

    async def receive(self) -> int:
        """Read one batch; returns how many records arrived."""
        if self._tc is not None:
            return len(await self._tc.getmany(timeout_ms=100, max_records=MAX_BATCH))
        assert self._rc is not None
        batches = await self._rc.getmany(timeout_ms=100, max_records=MAX_BATCH)
        return sum(len(v) for v in batches.values())


async def _throughput(client: _Client, n: int, bar: tqdm, cpu_us: list[float] | None = None) -> float:
    """msgs/s of one round; appends this process's CPU microseconds per message to ``cpu_us``."""
    received = 0
    c0 = time.process_time()
    t0 = time.perf_counter()

    async def consume() -> None:
        nonlocal received
        while received < n:
            got = await client.receive()
            received += got
            bar.update(got)

    reader = asyncio.create_task(consume())
    for i in range(n):
        await client.send(i)
    await client.flush()
    async with asyncio.timeout(120):
        await reader
    elapsed = time.perf_counter() - t0
    if cpu_us is not None:
        cpu_us.append((time.process_time() - c0) / n * 1e6)
    return n / elapsed


async def _latency(client: _Client, n: int, rate: float, bar: tqdm) -> list[float]:
    # Paced sends; records arrive in order per partition but not overall, so latencies are matched by
    # arrival count: with one message in flight at a time the k-th arrival is the k-th send.
    lat: list[float] = []
    gap = 1.0 / rate
    for i in range(n):
        t = time.perf_counter()
        await client.send(i)
        await client.flush()
        got = 0
        while got < 1:
            got += await client.receive()
        lat.append((time.perf_counter() - t) * 1000.0)
        bar.update(got)
        await asyncio.sleep(max(0.0, gap - (time.perf_counter() - t)))
    return lat


def _codec_us(messages: list[ChatRequest], repeats: int = 5) -> tuple[float, float]:
    """Median microseconds per message of ``encode`` and of ``decode`` over the prepared messages."""
    enc: list[float] = []
    dec: list[float] = []
    for _ in range(repeats):
        t = time.perf_counter()
        data = [encode(m, "bench-codec", i, 0) for i, m in enumerate(messages)]
        enc.append((time.perf_counter() - t) / len(messages) * 1e6)
        t = time.perf_counter()
        for d in data:
            decode(d)
        dec.append((time.perf_counter() - t) / len(messages) * 1e6)
    return statistics.median(enc), statistics.median(dec)


async def _run(args: argparse.Namespace, bootstrap: str) -> dict[str, Any]:
    tokens = [(i * 7919) % 32000 for i in range(args.tokens)]
    hashes = block_hashes(tokens, BLOCK, b"bench")
    messages = [_request(i, tokens, hashes) for i in range(args.messages)]

    run_id = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {
        "messages": args.messages,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "bootstrap": bootstrap,
    }
    results["payload_bytes"] = len(encode(messages[0], "bench", 0, 0))
    results["encode_us"], results["decode_us"] = _codec_us(messages[: min(len(messages), 2000)])
    # Both sides run under the collector settings every kvmesh service uses once started.
    tune_gc()
    results["gc_gen0_threshold"] = GC_GEN0_THRESHOLD
    warmup = min(200, args.messages)
    total = 2 * (args.rounds * (warmup + args.messages) + warmup + args.latency_messages)
    rates: dict[str, list[float]] = {"raw": [], "typed": []}
    # CPU time of this process per message: the client side's own cost, less hurt by a busy box
    # than wall-clock rates (the broker runs in its own process)
    cpu: dict[str, list[float]] = {"raw": [], "typed": []}
    fresh = itertools.count()

    async def started(label: str) -> _Client:
        # A fresh topic per measurement: the in-memory broker slows as a topic grows, so reusing one
        # would favour whichever side measures first in a round.
        prefix = f"bench-{run_id}-{label}{next(fresh)}."
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix)
        await ensure_topics(kafka, [REQUESTS])
        client = _Client(kafka, label == "typed", messages)
        await client.start()
        try:
            # Warm-up: connections, metadata and the first fetches are not what is measured.
            await _throughput(client, warmup, bar)
        except BaseException:
            await client.stop()
            raise
        return client

    with tqdm(total=total, desc="bench streams", unit="msg", file=sys.stderr) as bar:
        for r in range(args.rounds):
            order = ("raw", "typed") if r % 2 == 0 else ("typed", "raw")
            for label in order:
                client = await started(label)
                try:
                    rates[label].append(await _throughput(client, args.messages, bar, cpu[label]))
                finally:
                    await client.stop()
        for label in ("raw", "typed"):
            client = await started(label)
            try:
                lat = await _latency(client, args.latency_messages, args.rate, bar)
            finally:
                await client.stop()
            prefix = "" if label == "typed" else "raw_"
            results[f"{prefix}p50_ms"] = percentile(lat, 50, float("nan"))
            results[f"{prefix}p99_ms"] = percentile(lat, 99, float("nan"))
            results[f"{prefix}mean_ms"] = statistics.fmean(lat) if lat else float("nan")
    for label in ("raw", "typed"):
        results[f"{label}_msgs_per_s"] = statistics.median(rates[label])
        results[f"{label}_msgs_per_s_rounds"] = rates[label]
        results[f"{label}_cpu_us_per_msg"] = statistics.median(cpu[label])
    results["typed_vs_raw_throughput"] = results["typed_msgs_per_s"] / results["raw_msgs_per_s"]
    results["typed_vs_raw_rounds"] = [t / r for t, r in zip(rates["typed"], rates["raw"], strict=True)]
    # What the typed layer adds per message, from the medians; compare with encode_us + decode_us.
    results["typed_vs_raw_cpu"] = results["raw_cpu_us_per_msg"] / results["typed_cpu_us_per_msg"]
    results["typed_overhead_us"] = 1e6 / results["typed_msgs_per_s"] - 1e6 / results["raw_msgs_per_s"]
    results["typed_mb_per_s"] = results["typed_msgs_per_s"] * results["payload_bytes"] / 1e6
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh bench streams", description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="an existing broker (default: start an embedded tansu)")
    parser.add_argument("--messages", type=int, default=5000, help="messages in the throughput phase")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens per ChatRequest")
    parser.add_argument("--latency-messages", type=int, default=200)
    parser.add_argument("--rate", type=float, default=200.0, help="msgs/s in the latency phase")
    parser.add_argument("--rounds", type=int, default=5, help="alternating throughput rounds per client")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = parser.parse_args(argv)

    broker: EmbeddedBroker | None = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker = EmbeddedBroker()
        bootstrap = broker.start()
    try:
        results = asyncio.run(_run(args, bootstrap))
    finally:
        if broker is not None:
            broker.stop()
    out = sys.stdout
    out.write(
        f"payload {results['payload_bytes']} B, {args.messages} msgs\n"
        f"raw   {results['raw_msgs_per_s']:9.0f} msgs/s   p50 {results['raw_p50_ms']:.2f} ms"
        f"  p99 {results['raw_p99_ms']:.2f} ms\n"
        f"typed {results['typed_msgs_per_s']:9.0f} msgs/s   p50 {results['p50_ms']:.2f} ms"
        f"  p99 {results['p99_ms']:.2f} ms\n"
        f"typed/raw throughput {results['typed_vs_raw_throughput']:.2f} (median of {args.rounds} rounds)\n"
        f"codec per message: encode {results['encode_us']:.1f} us, decode {results['decode_us']:.1f} us\n"
        f"client CPU per message: raw {results['raw_cpu_us_per_msg']:.0f} us, "
        f"typed {results['typed_cpu_us_per_msg']:.0f} us\n"
    )
    if args.json:
        out.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
