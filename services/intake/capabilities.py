"""What the engines serving each model honour, learned from the workers' LoadReports.

A request field that needs an engine feature (``SamplingParams.features()``) is accepted only when
every live worker of the model announces it: the scheduler may send the request to any of them, and a
worker that cannot honour a field refuses the request rather than ignore it. Liveness is judged on this
intake's clock (a report seen within ``live_ms``); this is admission, not a routing decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from schemas.messages import LoadReport, ServiceHeartbeat
from schemas.report_signing import ReportCheck
from streams import topics
from streams.consumer import TypedConsumer
from streams.settings import KafkaSettings
from streams.tasks import stop_task

log = logging.getLogger("kvmesh.intake.capabilities")


@dataclass(frozen=True, slots=True)
class _Seen:
    model: str
    engine: str
    features: frozenset[str]
    seen_s: float
    #: The worker's decode step time (ms; 0 when it has not measured one).
    decode_ms: float = 0.0


class FeatureBoard:
    """Worker id → (model, engine, features) of its newest LoadReport. Pure; fed by :class:`FeatureFeed`."""

    def __init__(self, live_s: float = 10.0, block_size: int | None = None) -> None:
        self.live_s = live_s
        self.block_size = block_size
        self._workers: dict[str, _Seen] = {}
        self._replicas: dict[tuple[str, str], float] = {}  # (service, instance) -> seen_s

    def observe(self, report: LoadReport, now_s: float) -> None:
        refused = self.block_size is not None and report.block_size != self.block_size
        if report.draining or refused:
            # A draining worker takes no new requests, and the scheduler never routes to a worker of
            # another block size: what they honour does not matter.
            self._workers.pop(report.worker_id, None)
            return
        self._workers[report.worker_id] = _Seen(
            report.model, report.engine, frozenset(report.features), now_s, report.decode_ms_per_step
        )

    def observe_heartbeat(self, beat: ServiceHeartbeat, now_s: float) -> None:
        self._replicas[(beat.service, beat.instance_id)] = now_s

    def live_replicas(self, service: str, now_s: float) -> list[str]:
        """Instances of ``service`` (scheduler, kvmanager) whose heartbeat arrived within ``live_s``."""
        seen = list(self._replicas.items())
        return sorted(i for (svc, i), t in seen if svc == service and now_s - t <= self.live_s)

    def live(self, model: str, now_s: float) -> list[_Seen]:
        # list(): prepare may run in a worker thread while the feed adds reports
        seen = list(self._workers.values())
        return [w for w in seen if w.model == model and now_s - w.seen_s <= self.live_s]

    def features(self, model: str, now_s: float) -> frozenset[str] | None:
        """What every live worker of ``model`` honours; None when none has been seen."""
        live = self.live(model, now_s)
        if not live:
            return None
        return frozenset.intersection(*(w.features for w in live))

    def fastest_decode_ms(self, model: str, now_s: float) -> float | None:
        """The shortest decode step among live workers of ``model`` (None when none has measured one):
        no worker produces a token faster, so a completion longer than the deadline allows at this
        speed can never finish."""
        steps = [w.decode_ms for w in self.live(model, now_s) if w.decode_ms > 0]
        return min(steps) if steps else None

    def engines(self, model: str, now_s: float) -> list[str]:
        return sorted({w.engine for w in self.live(model, now_s)})


class FeatureFeed:
    """Reads the load and heartbeats topics (from their end: both repeat) into a :class:`FeatureBoard`."""

    def __init__(self, kafka: KafkaSettings, board: FeatureBoard, reports: ReportCheck | None = None) -> None:
        self.kafka = kafka
        self.board = board
        self.reports = reports or ReportCheck(None)
        self._consumer: TypedConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        consumer = TypedConsumer(
            self.kafka, [topics.LOAD, topics.HEARTBEATS], group_id=None, from_beginning=False
        )
        await consumer.start()
        self._consumer = consumer
        self._task = asyncio.create_task(self._run(), name="kvmesh-intake-features")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task, swallow_errors=True)
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                records = await self._consumer.getmany(timeout_ms=200)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("load consumer failed; retrying")
                await asyncio.sleep(0.5)
                continue
            now = time.monotonic()
            for r in records:
                if isinstance(r.message, LoadReport):
                    if self.reports.accept(r.message):  # a forged worker is never "live"
                        self.board.observe(r.message, now)
                elif isinstance(r.message, ServiceHeartbeat):
                    self.board.observe_heartbeat(r.message, now)
