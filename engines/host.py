"""Facts about the host that decide how an engine should run on it: whether bf16 is native, and a key that
names the host's compute for cached measurements.

On CPUs without native bf16 (no AVX512_BF16 or AMX on x86, no BF16 on Arm) PyTorch emulates it, and vLLM's
CPU kernels fall back: prefill there is about three times slower in bf16 than in float32 (README, "Engine").
On x86 CPUs with AMX, vLLM's CPU attention picks its AMX kernel for bf16, which answers wrongly there (vLLM
0.32, SmolLM2-135M: greedy "What is the capital of France?" gives "L'Étoile, la Marseillaise, ..." where the
same weights in bf16 under transformers, and vLLM with the AMX kernel switched off, say "The capital of France
is Paris."), so `auto` runs float32 on those hosts.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Literal

Dtype = Literal["bfloat16", "float16", "float32"]
DtypeChoice = Literal["auto", "bfloat16", "float16", "float32"]

# CPU feature flags (as /proc/cpuinfo names them) that give native bf16 matrix arithmetic.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# x86 flags under which vLLM's CPU attention runs bf16 on its AMX kernel (torch.cpu._is_amx_tile_supported).
_AMX_FLAGS = frozenset({"amx_tile"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (`flags` on x86, `Features` on Arm)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name, or the machine architecture when /proc/cpuinfo does not say."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return platform.machine()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            return value.strip()
    return platform.machine()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively rather than emulating it."""
    return bool((cpu_flags() if flags is None else flags) & _BF16_FLAGS)


def cpu_has_amx(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has AMX tiles (vLLM's CPU attention then runs bf16 on its AMX kernel)."""
    return bool((cpu_flags() if flags is None else flags) & _AMX_FLAGS)


def resolve_dtype(
    choice: DtypeChoice, *, gpu: bool, gpu_bf16: bool, cpu_bf16: bool, cpu_amx: bool = False
) -> Dtype:
    """The dtype to run: `auto` is bf16 where the device runs it natively, else float32 on CPUs (bf16 is
    emulated there) and float16 on GPUs without bf16. CPUs with AMX run float32: vLLM's AMX attention kernel
    answers wrongly in bf16 (module docstring); an explicit choice is taken as given."""
    if choice != "auto":
        return choice
    if gpu:
        return "bfloat16" if gpu_bf16 else "float16"
    return "bfloat16" if cpu_bf16 and not cpu_amx else "float32"


def detect_dtype(choice: DtypeChoice) -> Dtype:
    """`resolve_dtype` for this host (imports torch only when a GPU may be present)."""
    if choice != "auto":
        return choice
    gpu = gpu_bf16 = False
    if _may_have_gpu():
        import torch

        gpu = bool(torch.cuda.is_available())
        gpu_bf16 = gpu and bool(torch.cuda.is_bf16_supported())
    flags = cpu_flags()
    return resolve_dtype(
        choice,
        gpu=gpu,
        gpu_bf16=gpu_bf16,
        cpu_bf16=cpu_has_native_bf16(flags),
        cpu_amx=cpu_has_amx(flags),
    )


def _may_have_gpu() -> bool:
    return Path("/dev/nvidiactl").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def host_key(*parts: str) -> str:
    """A short key naming this host's compute (CPU model, its flags, cores) and `parts` (dtype, model...):
    measurements cached under it are only reused where they hold."""
    flags = cpu_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    text = "|".join([cpu_model(), ",".join(sorted(flags)), str(cores), *parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
