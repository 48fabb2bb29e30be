"""A replica's heartbeat: a ServiceHeartbeat on the heartbeats topic every ``interval_s``.

Schedulers and KV managers publish one (workers' LoadReports already are theirs), so that intake's
readiness and an operator can tell a live replica from a dead one without asking it. A publish that
fails (the broker is away) is logged and the next one tries again: a heartbeat task never dies.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from schemas.messages import ServiceHeartbeat
from streams import topics
from streams.clock import now_ms
from streams.producer import TypedProducer
from streams.tasks import stop_task

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        producer: TypedProducer,
        service: Literal["scheduler", "kvmanager"],
        instance_id: str,
        interval_s: float = 1.0,
    ) -> None:
        self.producer = producer
        self.service: Literal["scheduler", "kvmanager"] = service
        self.instance_id = instance_id
        self.interval_s = interval_s
        self.started_ms = now_ms()
        self.sent = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.instance_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _run(self) -> None:
        while True:
            beat = ServiceHeartbeat(self.service, self.instance_id, now_ms(), self.started_ms)
            try:
                async with asyncio.timeout(self.interval_s * 5):
                    await self.producer.send(topics.HEARTBEATS, beat)
                self.sent += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s %s heartbeat not sent: %s", self.service, self.instance_id, exc)
            await asyncio.sleep(self.interval_s)
