"""The simulated engine's real speed, which differs from the profile its workers publish.

Every policy (kvmesh included) sees only the published profile and the observed load. The simulated
engine runs the *truth*: the published profile with its times multiplied by factors, and with optional
seeded per-request noise on each prefill::

    --truth-scale prefill=1.3,decode=0.8,link=0.5,tier=1,noise=0.1,seed=7

``prefill``, ``decode``, ``link`` and ``tier`` multiply times (2 = twice as slow): prefill per token and
per token of context, one decode step, a peer transfer (bandwidth divided, latency multiplied), a
promotion from DRAM or disk. ``noise`` is the sigma of a log-normal factor with median 1 drawn once per
request from ``seed`` and the request id, so two runs of one trace see the same noise whatever the
policy or the order of decisions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

from kvmesh.sim.errors import SimError
from kvmesh_core.costmodel import PerfProfile

_KEYS = ("prefill", "decode", "link", "tier", "noise", "seed")


@dataclass(frozen=True, slots=True)
class TruthScale:
    """Factors from the published profile to the simulated engine's times."""

    prefill: float = 1.0
    decode: float = 1.0
    link: float = 1.0
    tier: float = 1.0
    noise: float = 0.0  # sigma of log(prefill factor) per request
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "link", "tier"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise SimError(f"truth scale {name} must be a positive number, got {v!r}")
        if not (math.isfinite(self.noise) and 0 <= self.noise <= 2):
            raise SimError(f"truth noise must be in [0, 2], got {self.noise!r}")

    @classmethod
    def parse(cls, text: str) -> TruthScale:
        """``key=value`` pairs separated by commas; keys: prefill, decode, link, tier, noise, seed."""
        values: dict[str, float | int] = {}
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in _KEYS:
                raise SimError(
                    f"--truth-scale expects KEY=VALUE with KEY in {', '.join(_KEYS)}; got {item!r}"
                )
            try:
                values[key] = int(raw) if key == "seed" else float(raw)
            except ValueError as exc:
                raise SimError(f"--truth-scale {key}: not a number: {raw!r}") from exc
        return cls(**values)  # type: ignore[arg-type]  # keys checked against _KEYS above

    @property
    def is_identity(self) -> bool:
        return self == TruthScale(seed=self.seed)

    def apply(self, p: PerfProfile) -> PerfProfile:
        """The profile the simulated engine really runs at."""
        if self.is_identity:
            return p
        return dataclasses.replace(
            p,
            prefill_ms_per_token=p.prefill_ms_per_token * self.prefill,
            prefill_ms_per_token_per_ctx=p.prefill_ms_per_token_per_ctx * self.prefill,
            decode_ms_per_step=p.decode_ms_per_step * self.decode,
            link_gbps=p.link_gbps / self.link,
            link_latency_ms=p.link_latency_ms * self.link,
            dram_gbps=p.dram_gbps / self.tier,
            disk_gbps=p.disk_gbps / self.tier,
        )

    def prefill_noise(self, request_id: str) -> float:
        """This request's prefill factor (1 without noise): a log-normal draw keyed by the request id,
        so it does not depend on which worker runs it or when."""
        if self.noise == 0:
            return 1.0
        digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=16).digest()
        # two uniforms in (0, 1) from the digest, then Box-Muller: a normal without a shared RNG state
        u1 = (int.from_bytes(digest[:8], "little") + 1) / (2**64 + 2)
        u2 = int.from_bytes(digest[8:], "little") / 2**64
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        return math.exp(self.noise * z)

    def describe(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)
