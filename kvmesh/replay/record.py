"""``kvmesh record``: copy a window of the kvmesh topics from Kafka to a recording file.

    kvmesh record --bootstrap 127.0.0.1:9092 --out window.rec [--since-ms T] [--until-ms T]
                  [--max-records N] [--topics kvmesh.requests,kvmesh.load,...]

The file holds the records byte for byte (streams.recording), so ``kvmesh replay`` decodes them with
the same strict codec as a live consumer. By default every topic the scheduler reads is recorded, plus
the assignments it wrote (what the replay compares against).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvmesh.replay.errors import ReplayError
from streams.recording import record_topics
from streams.settings import KafkaSettings
from streams.topics import ASSIGNMENTS, BY_NAME, CONTROL, KV_EVENTS, LOAD, REPLIES, REQUESTS, TopicSpec

#: What a replay of the scheduler needs: its inputs and its outputs (the recorded assignments).
SCHEDULER_TOPICS: tuple[TopicSpec, ...] = (REQUESTS, KV_EVENTS, LOAD, CONTROL, REPLIES, ASSIGNMENTS)


def parse_topics(text: str | None) -> list[TopicSpec]:
    """Catalog topics named in a comma list (all the scheduler's topics when empty)."""
    if not text:
        return list(SCHEDULER_TOPICS)
    out = []
    for name in (t.strip() for t in text.split(",")):
        if name not in BY_NAME:
            raise ReplayError(f"unknown topic {name!r}; known: {', '.join(BY_NAME)}")
        out.append(BY_NAME[name])
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh record", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap (default: KVMESH_KAFKA_* settings)")
    p.add_argument("--topic-prefix", default=None)
    p.add_argument("--out", required=True, help="recording file to write")
    p.add_argument("--topics", default=None, help="comma list of catalog topic names")
    p.add_argument("--since-ms", type=int, default=None, help="start at the first record at/after this time")
    p.add_argument("--until-ms", type=int, default=None, help="stop at a record newer than this time")
    p.add_argument("--max-records", type=int, default=None)
    p.add_argument("--idle-timeout-s", type=float, default=2.0)
    return p


def kafka_settings(bootstrap: str | None, topic_prefix: str | None) -> KafkaSettings:
    """KafkaSettings from the environment, with the command line's bootstrap / prefix on top."""
    base = KafkaSettings()
    return base.model_copy(
        update={
            "bootstrap_servers": bootstrap or base.bootstrap_servers,
            "topic_prefix": base.topic_prefix if topic_prefix is None else topic_prefix,
        }
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        topics = parse_topics(args.topics)
        kafka = kafka_settings(args.bootstrap, args.topic_prefix)
        n = asyncio.run(
            record_topics(
                kafka,
                topics,
                args.out,
                since_ms=args.since_ms,
                until_ms=args.until_ms,
                max_records=args.max_records,
                idle_timeout_s=args.idle_timeout_s,
            )
        )
    except (ReplayError, OSError) as exc:
        sys.stderr.write(f"kvmesh record: {exc}\n")
        return 2
    sys.stdout.write(f"recorded {n} records to {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
