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
