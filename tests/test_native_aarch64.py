"""The native kernels (``_fused.c``) built for AArch64, where the dots take rows of 4 lanes
(NEON's 128-bit registers; the note at ``lanes``): the same bits as this CPU's build at
every width, run under qemu (``tests/native_cross.c``), and the 4-lane build's vectors
kept in registers (16- or 8-lane vectors there went through the stack, as 16-lane ones did
in the AVX2 clone). Needs an AArch64 cross compiler and qemu's user mode
(``apt-get install gcc-aarch64-linux-gnu qemu-user``; ``.ci/run`` installs them)."""

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

MODULES = ROOT / "src" / "towerrec" / "modules"
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi", "-pthread"]

pytestmark = [
    pytest.mark.skipif(
        shutil.which(CROSS) is None or shutil.which(QEMU) is None,
        reason=f"needs {CROSS} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user)",
    ),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for this CPU's build"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux toolchains"),
]


def sources_in(folder: Path, fused: str | None = None) -> Path:
    """``_fused.c`` (or the text ``fused`` in its place) and the header it includes,
    copied into ``folder``; returns the copy of ``_fused.c``."""
    folder.mkdir()
    shutil.copy(MODULES / "_fused_lanes.h", folder / "_fused_lanes.h")
    target = folder / "_fused.c"
    target.write_text(fused if fused is not None else (MODULES / "_fused.c").read_text())
    return target


def harness(tmp_path: Path, compiler: str, extra: list[str]) -> Path:
    """``tests/native_cross.c`` around the extension's source, built with ``compiler``."""
    folder = sources_in(tmp_path / compiler).parent
    shutil.copy(ROOT / "tests" / "native_cross.c", folder / "native_cross.c")
    out = folder / "harness"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [compiler, *FLAGS, f"-I{include}", str(folder / "native_cross.c"), "-o", str(out), *extra],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def test_aarch64_build_gives_the_bits_of_this_cpus_build_at_every_width(tmp_path):
    libdir = sysconfig.get_config_var("LIBDIR")
    version = sysconfig.get_config_var("LDVERSION")
    native = harness(tmp_path, "gcc", [f"-L{libdir}", f"-lpython{version}", f"-Wl,-rpath,{libdir}"])
    # static, the interpreter's symbols left unresolved: the harness never calls them
    arm = harness(tmp_path, CROSS, ["-static", "-Wl,--unresolved-symbols=ignore-all"])
    expected = subprocess.run([str(native), "16"], check=True, capture_output=True).stdout
    assert len(expected) > 400_000
    for lanes in ("16", "8", "4"):
        here = subprocess.run([str(native), lanes], check=True, capture_output=True).stdout
        there = subprocess.run([QEMU, str(arm), lanes], check=True, capture_output=True).stdout
        assert here == expected, f"{lanes} lanes on this CPU"
        assert there == expected, f"{lanes} lanes on AArch64"


def vector_stack_accesses(assembly: str) -> int:
    """Loads and stores of whole vector registers (q) at the stack pointer or the frame
    pointer: spills, and vectors kept in memory."""
    return sum(
        1
        for line in assembly.splitlines()
        if re.search(r"\[(sp|x29)\b", line) and re.match(r"\s*(ldr|str|ldp|stp)\s+q\d", line)
    )


def test_aarch64_four_lane_kernels_keep_their_vectors_in_registers(tmp_path):
    """The file as an AArch64 CPU runs it (4 lanes alone: the other widths' code folded
    away) keeps its vectors in registers: a handful of vector loads and stores at the stack,
    where rows of 8 lanes took 575 (the AVX2 clone's 16-lane slowdown: 13.4 ms against
    0.31 for the dots backward, tools/kernel_clones.py)."""
    source = (MODULES / "_fused.c").read_text()
    fixed = source.replace("static int lanes = 4;", "#define lanes 4").replace(
        "    if (want) lanes = want;", "    (void)want;"
    )
    assert fixed.count("#define lanes 4") == 1 and "(void)want;" in fixed, "update this test"
    pinned = sources_in(tmp_path / "pinned", fixed)
    out = pinned.with_suffix(".s")
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [CROSS, *FLAGS, "-fopenmp", f"-I{include}", "-S", str(pinned), "-o", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    spills = vector_stack_accesses(out.read_text())
    assert spills < 64, f"{spills} vector loads and stores at the stack"
