"""Records written by earlier builds still decode, and each topic's decoder reads its own union only.

The fixtures in ``recorded/`` are bytes, frozen when they were written (see recorded_messages); a
change to a message type that breaks them breaks a fleet that upgrades with records in flight.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import msgspec
import pytest

from schemas import codec
from schemas.envelope import MAGIC
from schemas.errors import InvalidPayload, MalformedRecord, UnknownSchema, UnknownVersion
from schemas.messages import MESSAGE_TYPES, ChatRequest, KvEvent, LoadReport
from schemas.report_signing import verify
from schemas.token_ids import from_wire
from streams import topics
from tests.schemas.recorded_messages import HEADER, MESSAGES, OLDER

RECORDED = Path(__file__).parent / "recorded"


def _fixtures() -> list[tuple[str, str, int]]:
    current = [(f"{cls.SCHEMA}-v{cls.VERSION}", cls.SCHEMA, cls.VERSION) for cls in MESSAGE_TYPES]
    return [*current, *OLDER]


@pytest.mark.parametrize(("stem", "schema", "version"), _fixtures(), ids=lambda v: str(v))
def test_every_recorded_version_decodes_to_its_message(stem: str, schema: str, version: int) -> None:
    path = RECORDED / f"{stem}.bin"
    assert path.is_file(), f"no recorded bytes of {schema} v{version}: record them before changing it"
    env = codec.decode(path.read_bytes())
    assert (env.schema, env.version) == (schema, version)
    assert (env.producer, env.seq, env.event_ms) == HEADER
    assert env.message == MESSAGES[schema]
    assert type(env.message) is type(MESSAGES[schema])
    # and the topic that carries it reads it with its own decoder
    spec = next(t for t in topics.ALL_TOPICS if type(env.message) in t.messages)
    assert codec.decoder_for(spec.messages).decode(path.read_bytes()).message == MESSAGES[schema]


def test_a_recorded_load_report_signature_still_verifies() -> None:
    """The MAC covers the untagged encoding, so reports signed before the tag verify after it."""
    secret = b"fleet-secret"
    signature = bytes.fromhex((RECORDED / "load_report-signature.hex").read_text().strip())
    report = msgspec.structs.replace(MESSAGES["load_report"], signature=signature)
    assert verify(report, secret)
    assert not verify(msgspec.structs.replace(report, queue_depth=report.queue_depth + 1), secret)


def test_records_written_today_carry_the_tag_and_old_readers_skip_it() -> None:
    data = codec.encode(MESSAGES["kv_event"], *HEADER)
    raw = msgpack.unpackb(data, raw=False)
    assert raw[:3] == [MAGIC, "kv_event", KvEvent.VERSION] and raw[6]["type"] == "kv_event"
    # a reader that does not know the tag (the untagged per-type decoder) reads the same event
    assert (
        msgspec.msgpack.decode(msgpack.packb(raw[6]), type=KvEvent, dec_hook=from_wire)
        == (MESSAGES["kv_event"])
    )


def test_a_topic_decoder_refuses_a_type_its_topic_does_not_carry() -> None:
    data = codec.encode(MESSAGES["load_report"], *HEADER)
    with pytest.raises(UnknownSchema, match="do not travel on this topic"):
        codec.decoder_for(topics.KV_EVENTS.messages).decode(data)
    assert isinstance(codec.decoder_for(topics.LOAD.messages).decode(data).message, LoadReport)


def test_a_header_that_disagrees_with_the_payload_tag_is_refused() -> None:
    raw = msgpack.unpackb(codec.encode(MESSAGES["cancel_request"], *HEADER), raw=False)
    raw[1] = "chat_request"  # the header names one type, the payload's tag another
    with pytest.raises(InvalidPayload, match="chat_request"):
        codec.decoder_for(topics.REQUESTS.messages).decode(msgpack.packb(raw))


def test_newer_writers_extra_fields_and_trailing_header_elements_are_skipped() -> None:
    raw = msgpack.unpackb(codec.encode(MESSAGES["chat_request"], *HEADER), raw=False)
    raw[6]["added_in_a_later_version"] = [1, 2, 3]
    raw.append("a trailing header element")
    env = codec.decode(msgpack.packb(raw, use_bin_type=True))
    assert env.message == MESSAGES["chat_request"]


def test_header_faults_are_named() -> None:
    good = msgpack.unpackb(codec.encode(MESSAGES["drain_command"], *HEADER), raw=False)
    with pytest.raises(MalformedRecord, match="envelope"):
        codec.decode(msgpack.packb(["kvm9", *good[1:]]))
    with pytest.raises(MalformedRecord, match="envelope"):
        codec.decode(msgpack.packb([*good[:4], "seven", *good[5:]]))
    with pytest.raises(UnknownVersion, match="chat_request version 4"):
        codec.decode(msgpack.packb([MAGIC, "chat_request", ChatRequest.VERSION + 1, *good[3:]]))
    with pytest.raises(MalformedRecord, match="MessagePack"):
        codec.decode(b"\xc1")
