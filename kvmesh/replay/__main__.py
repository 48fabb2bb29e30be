"""``kvmesh replay``: re-run the scheduler over a recorded window; show where its decisions diverge.

    kvmesh replay window.rec [--policy P] [--router KEY=VALUE ...] [--view KEY=VALUE ...]
                  [--only-divergent] [--top K] [--explain REQUEST_ID] [--json]
    kvmesh replay --bootstrap 127.0.0.1:9092 [--since-ms T] [--until-ms T] [--max-records N] ...

A live scheduler stamps each assignment with its input positions, and such a recording replays
*exactly*: each decision is re-made on the state records the live one had applied, in the recorded
dispatch order (kvmesh.replay.exact); decisions whose inputs the recording lacks are listed as
unreproducible, never as divergences. Older recordings replay approximately, in timestamp order, and
the output says so. Without ``--policy`` the replay uses the policy named in the recorded assignments,
so a faithful replay shows zero divergences; ``--policy`` / ``--router`` answer "what would have
happened". With
``--json`` the last stdout line is one JSON object (``requests``, ``divergences``, ``dead``,
``decisions``). Exit status 0 either way (divergences are findings, not errors); 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kvmesh.replay.errors import ReplayError
from kvmesh.replay.exact import ExactDecision, ExactReport
from kvmesh.replay.record import kafka_settings, parse_topics
from kvmesh.replay.replayer import explain, fetch_window, format_decision, read_window, replay_any
from schemas.errors import SchemaError
from services.scheduler.errors import SchedulerError, UnknownPolicy
from services.scheduler.view import ViewSettings
from streams.errors import StreamsError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh replay", description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", help="recording file (kvmesh record); omit to read Kafka")
    p.add_argument("--bootstrap", default=None, help="read the window from this Kafka instead of a file")
    p.add_argument("--topic-prefix", default=None)
    p.add_argument("--topics", default=None)
    p.add_argument("--since-ms", type=int, default=None)
    p.add_argument("--until-ms", type=int, default=None)
    p.add_argument("--max-records", type=int, default=None)
    p.add_argument("--policy", default=None, help="decide with this policy instead of the recorded one")
    p.add_argument("--router", action="append", default=[], metavar="KEY=VALUE", help="RouterSettings")
    p.add_argument("--view", action="append", default=[], metavar="KEY=VALUE", help="ViewSettings")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--top", type=int, default=3, help="candidates shown per request")
    p.add_argument("--only-divergent", action="store_true")
    p.add_argument(
        "--explain", metavar="REQUEST_ID", default=None, help="the full candidate table of one decision"
    )
    p.add_argument("--json", action="store_true")
    return p


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs; a VALUE that parses as JSON (numbers, true, null) is taken as such."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ReplayError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.file:
            records = read_window(args.file)
        elif args.bootstrap:
            records = fetch_window(
                kafka_settings(args.bootstrap, args.topic_prefix),
                parse_topics(args.topics),
                since_ms=args.since_ms,
                until_ms=args.until_ms,
                max_records=args.max_records,
            )
        else:
            raise ReplayError("give a recording file or --bootstrap")
        try:
            view = dataclasses.replace(ViewSettings(), **parse_overrides(args.view))
        except TypeError as exc:
            raise ReplayError(f"bad view override: {exc}") from exc
        report = replay_any(
            records,
            policy=args.policy,
            router_overrides=parse_overrides(args.router),
            view_settings=view,
            block_size=args.block_size,
            top_k=args.top,
        )
    except UnknownPolicy as exc:
        # e.g. a simulator recording of its perfect-information reference, which no scheduler runs
        hint = "" if args.policy else " (the recorded policy; decide with another one: --policy NAME)"
        sys.stderr.write(f"kvmesh replay: {exc}{hint}\n")
        return 2
    except (ReplayError, SchedulerError, SchemaError, StreamsError, OSError) as exc:
        sys.stderr.write(f"kvmesh replay: {exc}\n")
        return 2
    if args.explain is not None:
        found = [d for d in report.decisions if d.request_id == args.explain]
        if not found:
            sys.stderr.write(f"kvmesh replay: no decision for request {args.explain!r} in the recording\n")
            return 2
        for d in found:  # a request re-decided after its worker was lost has several
            sys.stdout.write(explain(d) + "\n")
    else:
        for d in report.decisions:
            shown = d.diverged or (isinstance(d, ExactDecision) and not d.reproducible)
            if shown or not args.only_divergent:
                sys.stdout.write(format_decision(d, args.top) + "\n")
    line = (
        f"policy={report.policy} records={report.records} dead={report.dead} "
        f"requests={len(report.decisions)} divergences={report.divergences}"
    )
    if isinstance(report, ExactReport):
        lag = report.lag_summary()
        out_json = report.to_json(args.only_divergent, args.top)
        line += (
            f" unreproducible={report.unreproducible} mode=exact view_lag_p99_ms={lag['p99_ms']:g}"
            f" needless_fetches={out_json['needless_fetches']}/{out_json['fetch_plans']}"
        )
        q = out_json["prediction_quality"]
        line += (
            f" ttft_error_p50_ms={q['ttft_error_p50_ms']:.1f} hit_predicted={q['predicted_hit_tokens']}"
            f" hit_achieved={q['achieved_hit_tokens']}/{q['prompt_tokens']}"
        )
    else:
        out_json = report.to_json(args.only_divergent, args.top)
        line += " mode=approximate (the recording has no decision input positions)"
    sys.stdout.write(line + "\n")
    if args.json:
        sys.stdout.write(json.dumps(out_json, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
