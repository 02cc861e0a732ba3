"""What ``towerrec.hardware`` reads of a CPU from ``/proc/cpuinfo``: x86's model name and
flags, and AArch64's Features and core numbers, where bf16 units are ``bf16``."""

import pytest
import torch

from towerrec import hardware

X86 = {
    "processor": "0",
    "vendor_id": "AuthenticAMD",
    "model name": "AMD EPYC 9R14",
    "flags": "fpu sse4_2 avx avx2 fma f16c avx512f avx512_bf16 avx512_vnni",
}
# an AWS Graviton 3's first processor block
GRAVITON3 = {
    "processor": "0",
    "BogoMIPS": "2100.00",
    "Features": (
        "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt "
        "fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs "
        "paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng"
    ),
    "CPU implementer": "0x41",
    "CPU architecture": "8",
    "CPU variant": "0x1",
    "CPU part": "0xd40",
    "CPU revision": "1",
}
# an AWS Graviton 2 (Neoverse N1): NEON, no bf16
GRAVITON2 = {
    "processor": "0",
    "Features": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs",
    "CPU implementer": "0x41",
    "CPU part": "0xd0c",
}


@pytest.fixture
def cpuinfo(monkeypatch):
    def use(fields: dict[str, str]) -> None:
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: fields)

    return use


def test_x86_model_flags_and_bf16_units(cpuinfo):
    cpuinfo(X86)
    assert hardware.cpu_model() == "AMD EPYC 9R14"
    assert {"avx2", "avx512_bf16", "fma"} <= hardware.cpu_flags()
    assert hardware.bf16_units("cpu") == "avx512_bf16"


def test_aarch64_features_name_the_core_and_its_bf16_units(cpuinfo):
    cpuinfo(GRAVITON3)
    assert hardware.cpu_model() == "AArch64 Neoverse V1"
    flags = hardware.cpu_flags()
    assert {"asimd", "sve", "bf16", "i8mm"} <= flags
    assert hardware.bf16_units("cpu") == "bf16"
    vector = sorted(f for f in flags if f.startswith(hardware.VECTOR_FLAG_PREFIXES))
    assert vector == [
        "asimd",
        "asimddp",
        "asimdfhm",
        "asimdhp",
        "asimdrdm",
        "bf16",
        "i8mm",
        "sve",
        "svebf16",
        "svei8mm",
    ]


def test_aarch64_without_bf16_has_no_bf16_units(cpuinfo):
    cpuinfo(GRAVITON2)
    assert hardware.cpu_model() == "AArch64 Neoverse N1"
    assert "asimd" in hardware.cpu_flags() and hardware.bf16_units("cpu") is None


def test_an_unknown_aarch64_core_is_named_by_its_numbers(cpuinfo):
    cpuinfo({**GRAVITON2, "CPU implementer": "0x61", "CPU part": "0x022"})
    assert hardware.cpu_model() == "AArch64 implementer 0x61 part 0x022"


def test_no_cpuinfo_means_no_flags(cpuinfo):
    cpuinfo({})
    assert hardware.cpu_flags() == frozenset() and hardware.bf16_units("cpu") is None
    assert hardware.cpu_model()


def test_the_machine_key_tells_two_aarch64_cores_apart(cpuinfo):
    cpuinfo(GRAVITON3)
    v1 = hardware.machine_key(torch.device("cpu"))
    cpuinfo(GRAVITON2)
    n1 = hardware.machine_key(torch.device("cpu"))
    assert v1["cpu"] != n1["cpu"] and v1["cpu_vector_flags"] != n1["cpu_vector_flags"]
