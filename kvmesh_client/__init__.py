"""The producer SDK: publish chat requests straight to a kvmesh fleet's Kafka and stream the replies.

    async with KvmeshClient(KafkaSettings(bootstrap_servers="kafka:9092"), client_id="app") as client:
        async with await client.chat([ChatMessage("user", "Hello")]) as handle:
            async for chunk in handle.stream(timeout=30):
                ...

It sits above the transport (``streams``) and below the services: intake is built on it, as any
producer team's service would be. See ``examples/quickstart.py``.
"""

from kvmesh_client.client import KvmeshClient
from kvmesh_client.errors import ClientError, PublishTimeout, RequestClosed, RequestTimeout
from kvmesh_client.handle import ReplyRouter, RequestHandle
from kvmesh_core.text_stream import TextStream
from kvmesh_core.tokenizer import ChatMessage
from schemas.messages import Completion, SamplingParams, TokenChunk
from streams.settings import KafkaSettings

__all__ = [
    "ChatMessage",
    "ClientError",
    "Completion",
    "KafkaSettings",
    "KvmeshClient",
    "PublishTimeout",
    "ReplyRouter",
    "RequestClosed",
    "RequestHandle",
    "RequestTimeout",
    "SamplingParams",
    "TextStream",
    "TokenChunk",
]
