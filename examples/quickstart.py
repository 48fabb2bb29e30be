"""Publish a multi-turn chat straight to a kvmesh fleet's Kafka and stream each reply.

    kvmesh dev                                   # prints: ... broker 127.0.0.1:PORT
    KVMESH_KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:PORT python examples/quickstart.py

Every turn re-sends the whole conversation (as a chat client does); the fleet routes it to the worker
that holds the most of its KV cache, so the history is reused instead of recomputed. The Kafka
settings come from the environment (``KVMESH_KAFKA_*``: bootstrap servers, SASL, TLS).
"""

from __future__ import annotations

import asyncio
import sys
import uuid

from kvmesh_client import ChatMessage, KafkaSettings, KvmeshClient, RequestTimeout, TextStream

QUESTIONS = [
    "What is a KV cache?",
    "Why does a multi-turn chat benefit from it?",
    "And what happens when the GPU holding it is busy?",
]


async def main() -> int:
    session = uuid.uuid4().hex  # one session id per conversation: the fleet's routing hint
    history: list[ChatMessage] = [ChatMessage("system", "You are a terse assistant.")]
    async with KvmeshClient(KafkaSettings(), client_id=f"quickstart-{session[:8]}") as client:
        for turn, question in enumerate(QUESTIONS, 1):
            history.append(ChatMessage("user", question))
            # `async with` cancels the request on the fleet if we leave early (Ctrl-C, an error)
            async with await client.chat(history, session_id=session, max_tokens=24) as reply:
                print(f"turn {turn} > {question}\nturn {turn} < ", end="", flush=True)
                # tokens → text incrementally (a character split over two chunks is held back)
                text = TextStream(client.tokenizer)
                try:
                    async for chunk in reply.stream(timeout=60):
                        print(text.push(chunk.token_ids), end="", flush=True)
                except RequestTimeout as exc:
                    print(f"\n{exc}", file=sys.stderr)
                    return 1
                done = await reply.result()
            print(text.flush(), end="")
            print(
                f"\nturn {turn}: worker={done.worker_id} reused={done.reused_tokens} "
                f"fetched={done.fetched_tokens} recomputed={done.recomputed_tokens} "
                f"ttft_ms={done.ttft_ms:.1f}"
            )
            history.append(ChatMessage("assistant", text.text))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
