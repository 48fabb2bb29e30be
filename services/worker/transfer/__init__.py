"""The data plane: worker-to-worker KV block transfer (never through Kafka).

``BlockServer`` serves a worker's ``BlockSource``; ``BlockClient.fetch`` pulls a chained run of blocks
from a peer into a ``BlockSink`` and returns a ``FetchResult``; ``measure_link`` gives the link figures a
worker reports in its LoadReport. Wire format in ``frames``, fleet authentication in ``auth``.
"""

from services.worker.transfer.auth import FleetAuth, TransferSettings, resolve_secret
from services.worker.transfer.client import BlockClient, FailReason, FetchResult, LinkFigures, measure_link
from services.worker.transfer.errors import AuthFailed, FrameError, InsecureSecret, TransferError
from services.worker.transfer.metrics import TransferMetrics
from services.worker.transfer.server import BlockServer

__all__ = [
    "AuthFailed",
    "BlockClient",
    "BlockServer",
    "FailReason",
    "FetchResult",
    "FleetAuth",
    "FrameError",
    "InsecureSecret",
    "LinkFigures",
    "TransferError",
    "TransferMetrics",
    "TransferSettings",
    "measure_link",
    "resolve_secret",
]
