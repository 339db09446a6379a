"""The step budget chosen from a measured profile, the profile cache, and dtype by host."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.host import cpu_flags, cpu_has_amx, cpu_has_native_bf16, cpu_model, resolve_dtype
from engines.step_budget import StepClock, StepProfile, choose_budget, load_profile, save_profile

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma
"""
SAPPHIRE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
GRAVITON = """processor\t: 0
Features\t: fp asimd bf16 i8mm
"""


def profile(decode: float = 0.1, chunks: tuple[float, ...] = (0.4, 0.5, 0.6, 0.9, 0.9, 0.9)) -> StepProfile:
    return StepProfile(
        host="h", decode_step_s=decode, probe_budget=128, chunk_steps_s=chunks, measured_at=0.0
    )


def test_the_budget_fits_the_target_at_the_slowest_position() -> None:
    # The last chunks take 0.9 s for 128 tokens over a 0.1 s step: 6.25 ms per token.
    p = profile()
    assert p.worst_token_s == pytest.approx(0.8 / 128)
    budget = choose_budget(p, 0.5, max_model_len=2048, floor=16)
    assert budget % 16 == 0
    assert p.decode_step_s + budget * p.worst_token_s <= 0.5
    assert p.decode_step_s + (budget + 16) * p.worst_token_s > 0.5  # the largest multiple of 16 that fits
    # A twice as long target allows more than twice the tokens (the fixed cost is paid once).
    assert choose_budget(p, 1.0, max_model_len=2048, floor=16) > 2 * budget


def test_the_budget_is_bounded_by_the_context_and_the_floor() -> None:
    assert choose_budget(profile(), 1000.0, max_model_len=2048, floor=16) == 2048
    # A target below the fixed cost of a step cannot be met: the smallest budget vLLM takes.
    assert choose_budget(profile(decode=0.6), 0.5, max_model_len=2048, floor=32) == 32


def test_profiles_are_cached_atomically(tmp_path: Path) -> None:
    path = tmp_path / "profiles" / "h.json"
    assert load_profile(path) is None
    save_profile(path, profile())
    assert load_profile(path) == profile()
    path.write_text("{not json")
    assert load_profile(path) is None  # unreadable: measured again


def test_step_clock_counts_every_step_and_keeps_the_newest() -> None:
    clock = StepClock(keep=8)
    for i in range(20):
        clock.tick(float(i))
    assert clock.count == 20
    assert clock.ends[-1] == 19.0
    assert len(clock.ends) <= 8


def test_cpu_flags_and_native_bf16() -> None:
    assert "avx2" in cpu_flags(EPYC)
    assert cpu_model(EPYC) == "AMD EPYC"
    assert not cpu_has_native_bf16(cpu_flags(EPYC))
    assert cpu_has_native_bf16(cpu_flags(SAPPHIRE))
    assert cpu_has_native_bf16(cpu_flags(GRAVITON))
    assert cpu_has_amx(cpu_flags(SAPPHIRE))
    assert not cpu_has_amx(cpu_flags(EPYC))
    assert not cpu_has_amx(cpu_flags(GRAVITON))


@pytest.mark.parametrize(
    ("gpu", "gpu_bf16", "cpu_bf16", "cpu_amx", "expected"),
    [
        (False, False, False, False, "float32"),  # AVX2-only CPU: bf16 is emulated, about 3x slower
        (False, False, True, False, "bfloat16"),  # AVX512_BF16 without AMX
        (False, False, True, True, "float32"),  # AMX: vLLM's AMX attention kernel answers wrongly in bf16
        (True, True, False, False, "bfloat16"),
        (True, False, False, False, "float16"),  # pre-Ampere GPU
    ],
)
def test_auto_dtype_follows_the_hardware(
    gpu: bool, gpu_bf16: bool, cpu_bf16: bool, cpu_amx: bool, expected: str
) -> None:
    host = {"gpu": gpu, "gpu_bf16": gpu_bf16, "cpu_bf16": cpu_bf16, "cpu_amx": cpu_amx}
    assert resolve_dtype("auto", **host) == expected
    assert resolve_dtype("float16", **host) == "float16"
    assert resolve_dtype("bfloat16", **host) == "bfloat16"
