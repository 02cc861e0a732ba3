"""Time the native kernels (``modules/_fused.c``) as each instruction set's clone runs
them, on this one CPU: the extension built once per target with every function compiled
for that target alone (in place of GCC's ``target_clones``), and the width of the dots'
kernels (``vector_lanes``: 16, 8 or 4 lanes) set as a CPU of that kind sets it. So a
machine with AVX-512 shows what an AVX2 machine's code does, or a CPU with SSE alone,
without one (the memory system and clock stay this machine's: the ratios compare code,
not CPUs). Prints JSON::

    python tools/kernel_clones.py [--targets avx512f,avx2,default] [--before REV] [--rounds 7]

``--emulate TARGET -- COMMAND ...`` runs COMMAND with the whole software stack on
TARGET's code: the extension built for TARGET alone (and its kernels' width chosen as
that CPU's import chooses it) imported in its place, ATen's kernels
held to TARGET (``ATEN_CPU_CAPABILITY``) and oneDNN's too (``ONEDNN_MAX_CPU_ISA``); FBGEMM
picks its own. With ``--before REV``, REV's ``_fused.c`` (and header). For example::

    python tools/kernel_clones.py --emulate avx2 -- towerrec bench train --json --precisions fp32

``--before REV`` builds the same targets from git revision REV's ``_fused.c`` too (its
rows named ``REV:target``), for a change's effect in the same run. ``--step`` adds whole
training steps of the Criteo-Kaggle DLRM (torch kernel, fp32 or ``--step bf16``) with each
build in place of the installed extension, alternating blocks of 20 steps (ATen's own
kernels stay this CPU's).

Criteo-Kaggle shape (26 tables of 100,000 rows, dim 16, batch 2,048, two threads):
the pairwise dots forward and backward, the top MLP's input built and its gradients
(``concat_*``, float32), the pooled lookup (``bag_sum``) and the row-wise Adagrad
update's sums (``row_sums``). The builds alternate call by call; each reports its
fastest round of 10 calls. Needs gcc and Python's headers (``python3-config``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from towerrec.calibration.machine import machine_info
from towerrec.hardware import cpu_flags
from towerrec.memory import advise_huge_pages, reuse_freed_memory

SOURCE = Path(__file__).resolve().parent.parent / "src" / "towerrec" / "modules" / "_fused.c"
CLONES = '#define DOTS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))'
FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi", "-pthread", "-fopenmp"]


# The extension's files: the source and the header it includes (its kernels per width).
FILES = ("_fused.c", "_fused_lanes.h")
# The lanes of the dots' kernels a CPU of each target gets at import (``_fused.c``, the
# note at ``lanes``).
TARGET_LANES = {"avx512f": 16, "avx2": 8, "default": 4}
Source = dict[str, str]  # file name -> text


def current_source() -> Source:
    """The working tree's ``_fused.c`` and the header it includes."""
    return {
        name: (SOURCE.parent / name).read_text()
        for name in FILES
        if (SOURCE.parent / name).exists()
    }


def revision_source(revision: str) -> Source:
    """``_fused.c`` and the header it includes at git revision ``revision`` (revisions
    from before the header have the source alone)."""
    files = {}
    for name in FILES:
        shown = subprocess.run(
            ["git", "show", f"{revision}:src/towerrec/modules/{name}"],
            cwd=SOURCE.parent, capture_output=True, text=True,
        )  # fmt: skip
        if shown.returncode == 0:
            files[name] = shown.stdout
        elif name == "_fused.c":
            raise SystemExit(f"no _fused.c at {revision}: {shown.stderr.strip()}")
    return files


def set_lanes(module: ModuleType, target: str) -> None:
    """The width of the dots' kernels that a CPU of ``target``'s kind gets at import:
    ``vector_lanes``, or ``wide_vectors`` (16 lanes or 8) in builds from before it."""
    if hasattr(module, "vector_lanes"):
        module.vector_lanes(TARGET_LANES[target])
    elif hasattr(module, "wide_vectors"):
        module.wide_vectors(target.startswith("avx512"))


def build(source: Source, target: str, folder: Path) -> ModuleType:
    """``source`` (``_fused.c`` and its header) with every cloned function compiled for
    ``target`` alone, loaded from ``folder``, its width set as on a CPU of that kind."""
    if CLONES not in source["_fused.c"]:
        raise SystemExit(f"_fused.c no longer defines DOTS_CLONES as {CLONES!r}; update this tool")
    folder.mkdir(parents=True)
    pinned_clones = (
        "#define DOTS_CLONES"  # the baseline: the compiler's defaults
        if target == "default"
        else f'#define DOTS_CLONES __attribute__((target("{target}")))'
    )
    for name, text in source.items():
        (folder / name).write_text(text.replace(CLONES, pinned_clones))
    pinned = folder / "_fused.c"
    library = folder / target / ("_fused" + sysconfig.get_config_var("EXT_SUFFIX"))
    library.parent.mkdir()
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        ["gcc", *FLAGS, "-fPIC", "-shared", f"-I{include}", str(pinned), "-o", str(library)],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("_fused", library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    set_lanes(module, target)
    return module


def cases() -> dict[str, Callable[[ModuleType, int], None]]:
    """Each kernel's call at the Criteo-Kaggle shape, given the module and a batch index."""
    tables, rows, dim, batch = 26, 100_000, 16, 2048
    features = tables + 1
    pair_rows, pair_cols = torch.triu_indices(features, features, offset=1)
    pairs = pair_rows.numel()
    width = dim + pairs + 1
    r, c = pair_rows.numpy(), pair_cols.numpy()
    x = torch.randn(batch, features, dim)
    dots = torch.empty(batch, pairs)
    grad = torch.randn(batch, pairs)
    gx = torch.empty(batch, features, dim)
    bottom = torch.randn(batch, dim)
    pooled = torch.randn(batch, tables * dim)
    joined = torch.empty(batch, width)
    upstream = torch.randn(batch, width)
    g_bottom = torch.empty(batch, dim)
    g_pooled = torch.empty(batch, tables * dim)
    weight = torch.empty(tables * rows, dim)
    advise_huge_pages(weight.data_ptr(), weight.nbytes)
    weight.normal_()
    momentum = torch.zeros(tables * rows)
    ids = [
        (torch.randint(0, rows, (tables, batch)) + torch.arange(tables)[:, None] * rows)
        .reshape(-1)
        .contiguous()
        for _ in range(8)
    ]
    offsets = torch.arange(tables * batch + 1)
    out = torch.empty(batch, tables * dim)
    lookup_grad = torch.randn(batch, tables * dim)
    feature_tables = torch.arange(tables)
    found = torch.empty(tables * batch, dtype=torch.int64)
    sums = torch.empty(tables * batch, dim)
    state = torch.empty(tables * batch)
    # the joined input's calls: x, the pooled rows and the pairs; its shape, fp32, 2 threads
    joined_inputs = (bottom.numpy(), pooled.numpy(), r, c)
    joined_shape = (batch, tables, dim, pairs, width, False, 2)
    return {
        "dots_forward": lambda m, i: m.forward(
            x.numpy(), r, c, dots.numpy(), batch, features, dim, pairs, 2
        ),
        "dots_backward": lambda m, i: m.backward(
            x.numpy(), r, c, grad.numpy(), gx.numpy(), batch, features, dim, pairs, 2
        ),
        "concat_forward": lambda m, i: m.concat_forward(
            *joined_inputs, joined.numpy(), *joined_shape
        ),
        "concat_backward": lambda m, i: m.concat_backward(
            *joined_inputs, upstream.numpy(), g_bottom.numpy(), g_pooled.numpy(), *joined_shape
        ),
        "bag_sum": lambda m, i: m.bag_sum(
            weight.numpy(),
            ids[i].numpy(),
            offsets.numpy(),
            out.numpy(),
            None,
            False,
            tables,
            batch,
            dim,
            tables * rows,
        ),
        "row_sums": lambda m, i: m.row_sums(
            ids[i].numpy(),
            offsets.numpy(),
            lookup_grad.numpy(),
            None,
            False,
            tables,
            batch,
            dim,
            tables * rows,
            found.numpy(),
            sums.numpy(),
            feature_tables.numpy(),
            momentum.numpy(),
            state.numpy(),
        ),
    }


def steps(modules: dict[str, ModuleType], precision: str, rounds: int) -> dict[str, float]:
    """The median step (ms) of the Criteo-Kaggle DLRM with each build as the extension."""
    from towerrec.bench.choice import SHAPES
    from towerrec.bench.train import _towerrec_row, make_batches
    from towerrec.modules import interaction
    from towerrec.modules.kernels import base, torch_kernel
    from towerrec.train.numerics import set_flush_subnormals
    from towerrec.train.step import train_step

    set_flush_subnormals(True)
    shape = SHAPES["criteo_kaggle"]
    dtype = torch.bfloat16 if precision == "bf16" else None
    model, optimizer = _towerrec_row(shape, "torch")
    batches = make_batches(shape, 2048, 8)
    times: dict[str, list[float]] = {k: [] for k in modules}
    for r in range(rounds + 1):
        for key, module in modules.items():
            module.flush_subnormals(True)
            for user in (interaction, torch_kernel, base):  # where the kernels are called from
                setattr(user, "_native" if user is interaction else "fused", module)
            for i in range(3):
                train_step(model, optimizer, batches[i % 8], dtype)
            start = time.perf_counter()
            for i in range(20):
                train_step(model, optimizer, batches[i % 8], dtype)
            if r:  # the first round warms up
                times[key].append((time.perf_counter() - start) / 20 * 1e3)
    return {f"{k}_ms": round(sorted(v)[len(v) // 2], 2) for k, v in times.items()}


EMULATED = {"avx2": ("avx2", "AVX2"), "default": ("default", "SSE41")}

BOOT = """\
import importlib.util, sys
import torch  # first, as towerrec.modules.native imports it: the extension binds to its OpenMP
spec = importlib.util.spec_from_file_location("towerrec.modules._fused", {library!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
if hasattr(module, "vector_lanes"):
    module.vector_lanes({lanes})
elif hasattr(module, "wide_vectors"):  # a build from before vector_lanes (--before)
    module.wide_vectors(False)
    module.vector_lanes = lambda: 16 if module.wide_vectors() else 8
sys.modules["towerrec.modules._fused"] = module
"""


def emulate(target: str, source: Source, command: list[str], folder: Path) -> int:
    """Run ``command`` with the software stack on ``target``'s code (module doc)."""
    if target not in EMULATED:
        raise SystemExit(f"--emulate takes one of {', '.join(EMULATED)}, not {target!r}")
    if not command:
        raise SystemExit("give the command to run after --")
    aten, onednn = EMULATED[target]
    build(source, target, folder / "build")
    library = next((folder / "build" / target).glob("_fused*"))
    boot = folder / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(
        BOOT.format(library=str(library), lanes=TARGET_LANES[target])
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=aten, ONEDNN_MAX_CPU_ISA=onednn)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot), env.get("PYTHONPATH")) if p)
    return subprocess.run(command, env=env).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="avx512f,avx2")
    parser.add_argument("--before", help="a git revision whose _fused.c to build too")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--step", nargs="?", const="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--emulate", metavar="TARGET", help="run the command after -- on it")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.emulate:
        source = revision_source(args.before) if args.before else current_source()
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        with tempfile.TemporaryDirectory() as tmp:
            raise SystemExit(emulate(args.emulate, source, command, Path(tmp)))
    torch.set_num_threads(2)
    reuse_freed_memory()
    targets = args.targets.split(",")
    sources = {"": current_source()}
    if args.before:
        sources[f"{args.before}:"] = revision_source(args.before)
    with tempfile.TemporaryDirectory() as tmp:
        modules = {
            f"{label}{t}": build(text, t, Path(tmp) / f"{n}-{t}")
            for n, (label, text) in enumerate(sources.items())
            for t in targets
        }
        results: dict[str, dict[str, float]] = {}
        for name, call in cases().items():
            best = dict.fromkeys(modules, float("inf"))
            for _ in range(args.rounds):
                for key, module in modules.items():
                    start = time.perf_counter()
                    for i in range(10):
                        call(module, i % 8)
                    best[key] = min(best[key], (time.perf_counter() - start) / 10 * 1e3)
            first = next(iter(modules))
            results[name] = {f"{k}_ms": round(v, 3) for k, v in best.items()}
            for k, v in best.items():
                if k != first:
                    results[name][f"{k}/{first}"] = round(v / best[first], 2)
        if args.step:
            results[f"train_step_{args.step}"] = steps(modules, args.step, args.rounds)
    flags = sorted(f for f in cpu_flags() if f.startswith("avx"))
    report = {
        "benchmark": "kernel_clones",
        "machine": {**machine_info(), "cpu_flags": flags},
        "threads": 2,
        "rounds": args.rounds,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
