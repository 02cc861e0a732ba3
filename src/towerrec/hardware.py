"""What this machine is, as far as the speed of a kernel can depend on it.

- ``cpu_model()``, ``cpu_flags()``: from ``/proc/cpuinfo`` (Linux: x86's ``model name``
  and ``flags``; AArch64's ``Features``, and its implementer and part for the model,
  named where the part is a known server core; elsewhere the platform's processor name
  and no flags).
- ``bf16_units(device)``: whether ``device`` has bf16 arithmetic units, and which: a
  CPU with AMX (``amx_bf16``), AVX-512 BF16 (``avx512_bf16``) or AArch64's BF16
  instructions (``bf16``: Neoverse V1 and later, as in AWS Graviton 3 and NVIDIA
  Grace), a CUDA GPU that supports bf16. Elsewhere bf16 matmuls convert to fp32 and run
  slower than fp32.
- ``machine_key(device)``: the description a measured choice is valid for: the CPU
  (model, the flags of its vector units, a digest of all its flags), the ATen kernels'
  capability, the torch and FBGEMM versions, the GPU's name, and the environment
  variables that change which code the math libraries run (``ATEN_CPU_CAPABILITY``,
  ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``, ``LD_PRELOAD``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform

import torch

__all__ = ["bf16_units", "cpu_flags", "cpu_model", "machine_key"]

BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # the last AArch64's (FEAT_BF16)
# The flags of the vector units: x86's, then AArch64's (NEON, SVE, its bf16 and int8 dots)
VECTOR_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve", "bf16", "i8mm")
# AArch64 cores by (CPU implementer, CPU part) in /proc/cpuinfo: Arm's server cores
ARM_CORES = {
    ("0x41", "0xd0c"): "Neoverse N1",
    ("0x41", "0xd40"): "Neoverse V1",
    ("0x41", "0xd49"): "Neoverse N2",
    ("0x41", "0xd4f"): "Neoverse V2",
}
LIBRARY_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "LD_PRELOAD")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    info = _cpuinfo()
    if info.get("model name"):
        return info["model name"]
    implementer, part = info.get("CPU implementer"), info.get("CPU part")
    if implementer and part:  # AArch64 names its core by numbers
        core = ARM_CORES.get((implementer.lower(), part.lower()))
        return f"AArch64 {core or f'implementer {implementer} part {part}'}"
    return platform.processor() or "unknown"


def cpu_flags() -> frozenset[str]:
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def bf16_units(device: torch.device | str) -> str | None:
    """The bf16 units of ``device`` (``"amx_bf16"``, ``"avx512_bf16"``, ``"bf16"``, ``"cuda"``), or
    None where it has none."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda" if torch.cuda.is_bf16_supported() else None
    flags = cpu_flags()
    return next((flag for flag in BF16_FLAGS if flag in flags), None)


def _fbgemm_version() -> str | None:
    for name in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_key(device: torch.device | str) -> dict:
    """The machine a measurement on ``device`` holds for (module doc), as JSON values."""
    device = torch.device(device)
    flags = cpu_flags()
    key = {
        "cpu": cpu_model(),
        "cpu_vector_flags": sorted(f for f in flags if f.startswith(VECTOR_FLAG_PREFIXES)),
        "cpu_flags_sha1": hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "fbgemm": _fbgemm_version(),
        "env": {name: os.environ[name] for name in LIBRARY_ENV if name in os.environ},
        "device": device.type,
    }
    if device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(device)
    return key
