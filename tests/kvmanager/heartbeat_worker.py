"""A stand-in worker process for the liveness test: announces one block, then heartbeats every 200 ms.

Usage: python heartbeat_worker.py BOOTSTRAP WORKER_ID [TOPIC_PREFIX]
"""

from __future__ import annotations

import asyncio
import sys

from schemas.messages import KvEvent, LoadReport, TierUsage
from streams.clock import now_ms
from streams.producer import TypedProducer
from streams.settings import KafkaSettings
from streams.topics import KV_EVENTS, LOAD


async def main(bootstrap: str, worker: str, prefix: str) -> None:
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix)
    async with TypedProducer(kafka, worker) as producer:
        await producer.send(
            KV_EVENTS, KvEvent(worker, "stored", "gpu", [777, 778], [0, 777], event_ms=now_ms())
        )
        while True:
            report = LoadReport(
                worker_id=worker,
                report_ms=now_ms(),
                queue_depth=0,
                active_requests=0,
                active_tokens=0,
                queued_prefill_tokens=0,
                tiers=[TierUsage("gpu", 10, 10)],
                transfer_address="127.0.0.1:1",
                block_size=16,
                block_bytes=1024,
                prefill_ms_per_token=0.1,
            )
            await producer.send(LOAD, report)
            sys.stdout.write("beat\n")
            sys.stdout.flush()
            await asyncio.sleep(0.2)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
