"""The prefill cost fit behind Engine.calibrate: robust to noise, never negative or degenerate."""

from __future__ import annotations

import pytest

from kvmesh_core.costmodel import recompute_ms
from services.worker.calibration import fit_prefill_cost
from services.worker.engine import Engine, EngineConfig


def test_fit_recovers_exact_coefficients() -> None:
    a, b = 0.05, 2e-4
    samples = [(n, n * (a + b * n / 2)) for n in (128, 256, 384, 512)]
    fa, fb = fit_prefill_cost(samples)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)


def test_noisy_samples_never_give_negative_or_zero_terms() -> None:
    # per-token cost that shrinks with length (a busy machine during the short runs)
    a, b = fit_prefill_cost([(128, 20.0), (256, 25.0), (512, 40.0)])
    assert a > 0 and b == 0.0
    # almost purely quadratic timings keep a real per-token term
    a, b = fit_prefill_cost([(128, 0.1), (256, 0.5), (512, 2.0)])
    assert a >= 0.5 * 0.1 / 128 and b > 0


def test_calibrated_profile_prices_prompts_like_the_engine_runs_them() -> None:
    engine = Engine(EngineConfig(gpu_blocks=128, dram_blocks=0))
    p = engine.calibrate()
    assert p.prefill_ms_per_token > 0 and p.prefill_ms_per_token_per_ctx >= 0 and p.decode_ms_per_step > 0
    # a long prompt costs more than a short one, and not absurdly more than linear scaling allows
    short, long = recompute_ms(p, 128), recompute_ms(p, 1024)
    assert short < long < 8 * short * 8
