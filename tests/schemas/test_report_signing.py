"""LoadReports signed with the fleet secret: any change, another secret or no signature fails."""

from __future__ import annotations

import msgspec

from schemas.codec import decode, encode
from schemas.messages import LoadReport, TierUsage
from schemas.report_signing import ReportCheck, sign, verify

SECRET = b"fleet-secret"


def _report(**kw: object) -> LoadReport:
    base = LoadReport(
        "worker-0", 1000, 1, 2, 300, 40, [TierUsage("gpu", 10, 100)], "127.0.0.1:7000", 16, 4096, 0.1
    )
    return msgspec.structs.replace(base, **kw)  # type: ignore[arg-type]


def test_a_signed_report_verifies_through_the_wire_and_nothing_else_does() -> None:
    signed = sign(_report(), SECRET)
    assert verify(signed, SECRET)
    assert verify(decode(encode(signed, "worker-0", 1, 1000)).message, SECRET)
    assert not verify(signed, b"another-secret")
    assert not verify(_report(), SECRET)  # unsigned
    # a worker's int figure decodes as a float on the other side: the signature still holds
    as_int = sign(_report(decode_ms_per_step=3, features=("stop", "logprobs")), SECRET)
    assert verify(decode(encode(as_int, "worker-0", 2, 1000)).message, SECRET)
    for change in ({"queue_depth": 0}, {"worker_id": "worker-9"}, {"transfer_address": "10.0.0.1:1"}):
        assert not verify(msgspec.structs.replace(signed, **change), SECRET), change  # type: ignore[arg-type]


def test_the_check_takes_everything_without_a_secret_and_only_verified_reports_with_one() -> None:
    forged = _report(worker_id="fake")
    assert ReportCheck(None).accept(forged)
    check = ReportCheck(SECRET)
    assert check.accept(sign(_report(), SECRET))
    assert not check.accept(forged) and not check.accept(sign(forged, b"guess"))
    assert check.refused == 2


def _signed_as_before_the_budget_field(report: LoadReport) -> LoadReport:
    """What a worker from before the fields added since signing began signed: the canonical body
    without them."""
    import hashlib
    import hmac

    raw = msgspec.msgpack.encode(msgspec.structs.replace(report, signature=b""))
    plain = msgspec.to_builtins(msgspec.msgpack.decode(raw, type=LoadReport), builtin_types=(bytes,))
    for name in (
        "type",
        "prefill_chunk_tokens",
        "slot_wait_steps",
        "recent_decode_ms_per_step",
        "kv_free_blocks",
        "kv_release",
    ):
        del plain[name]
    mac = hmac.new(SECRET, b"kvmesh.load_report.v1\0" + msgspec.msgpack.encode(plain), hashlib.sha256)
    return msgspec.structs.replace(report, signature=mac.digest()[:16])


def test_a_report_from_a_worker_before_a_field_was_added_still_verifies() -> None:
    """A rolling upgrade: older workers' reports lack the fields added since, decode with their defaults,
    and must still verify; a set value of a new field is signed like any other."""
    old = _signed_as_before_the_budget_field(_report())
    assert verify(old, SECRET)
    assert verify(decode(encode(old, "worker-0", 1, 1000)).message, SECRET)
    budget = sign(_report(prefill_chunk_tokens=2048), SECRET)
    assert verify(budget, SECRET) and budget.signature != old.signature
    assert not verify(msgspec.structs.replace(budget, prefill_chunk_tokens=512), SECRET)
    assert not verify(msgspec.structs.replace(old, prefill_chunk_tokens=512), SECRET)
    waits = sign(_report(prefill_chunk_tokens=2048, slot_wait_steps=40), SECRET)
    assert verify(waits, SECRET) and not verify(msgspec.structs.replace(waits, slot_wait_steps=0), SECRET)
    room = sign(_report(kv_free_blocks=-3, kv_release=[(12, 300), (50, 120)]), SECRET)
    assert verify(room, SECRET) and verify(decode(encode(room, "worker-0", 1, 1000)).message, SECRET)
    assert not verify(msgspec.structs.replace(room, kv_release=[(12, 300)]), SECRET)
    assert not verify(msgspec.structs.replace(room, kv_free_blocks=0), SECRET)
