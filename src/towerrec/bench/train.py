"""``towerrec bench train``: single-process DLRM training throughput.

The Criteo-Kaggle shape: 13 dense features, 26 tables of 100k rows, dim 16,
bottom MLP 512-256-64-16, top MLP 512-256-1, batch 2048, one id per table,
Adam on the dense part and exact row-wise Adagrad fused into the embedding
backward. Every system trains on the same pre-generated batches in the same
process, timed round-robin (see ``time_interleaved``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from towerrec.bench.common import (
    Benchmark,
    comma_list,
    keeps_process_settings,
    machine_info,
    peak_rss_mb,
    set_threads,
    time_interleaved,
)
from towerrec.bench.device_train import PRECISIONS, run_device_train_benchmark
from towerrec.bench.plain_dlrm import plain_dlrm, plain_step
from towerrec.bench.roofline import Roofline, layer_matmul_seconds, measure_roofline
from towerrec.bench.torchrec_ref import (
    quiet_torchrec_logs,
    single_process_group,
    torchrec_available,
    torchrec_dlrm,
    torchrec_dlrm_fused,
    torchrec_step,
)
from towerrec.bench.train_profile import profile_step
from towerrec.bench.train_report import (
    StepWork,
    add_peer_ratios,
    batch_embedding_bytes,
    roofline_fields,
)
from towerrec.build.choices import Choice, resolve_choices
from towerrec.config import Config, load_config
from towerrec.data.batch import Batch, DataSchema, SparseFeature
from towerrec.hardware import VECTOR_FLAG_PREFIXES, cpu_flags
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.kernels import fbgemm_available
from towerrec.modules.native import native_lanes
from towerrec.modules.tables import TableConfig
from towerrec.optim.adam import Adam
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.step import autocast_dtype, train_step

__all__ = [
    "BENCHMARK",
    "CRITEO_SHAPE",
    "PLANTED_SHAPE",
    "SHAPES",
    "add_timing_arguments",
    "default_choices",
    "make_batches",
    "run_train_benchmark",
    "selected_backends",
    "shape_inputs",
]

CRITEO_SHAPE: dict[str, Any] = {
    "num_dense": 13,
    "num_tables": 26,
    "num_embeddings": 100_000,
    "embedding_dim": 16,
    "bottom_mlp": [512, 256, 64, 16],
    "top_mlp": [512, 256, 1],
}
# `towerrec train`'s built-in default (configs/default.toml): the planted data's tables
PLANTED_SHAPE: dict[str, Any] = {
    "num_dense": 13,
    "num_tables": 9,
    "num_embeddings": [300, 100, 1000, 50, 500, 200, 100, 200, 500],
    "pooling_factors": [1, 1, 1, 1, 1, 1, 1, 1, 3],
    "embedding_dim": 16,
    "bottom_mlp": [64, 16],
    "top_mlp": [64, 32, 1],
}
SHAPES = {"criteo_kaggle": CRITEO_SHAPE, "planted": PLANTED_SHAPE}
EMB_LR, DENSE_LR = 0.05, 1e-3
PRECISION_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_ROW = "towerrec_default"


def table_rows(shape: dict) -> list[int]:
    """Rows of each table: ``num_embeddings`` (one count for every table, or one each)."""
    rows = shape["num_embeddings"]
    return [rows] * shape["num_tables"] if isinstance(rows, int) else list(rows)


def pooling_factors(shape: dict) -> list[float]:
    """Mean ids per sample of each table (``pooling_factors``; one each by default)."""
    return list(shape.get("pooling_factors") or [1] * shape["num_tables"])


def make_batches(shape: dict, batch_size: int, count: int = 8, seed: int = 0) -> list[Batch]:
    """``count`` random batches, uniform ids, features ``f0..``; table t's bag i holds
    floor((i+1) p) - floor(i p) ids (p its pooling factor: one id at p = 1)."""
    gen = torch.Generator().manual_seed(seed)
    tables = shape["num_tables"]
    index = torch.arange(batch_size + 1, dtype=torch.float64)
    lengths = torch.cat([torch.floor(index * p).long().diff() for p in pooling_factors(shape)])
    out = []
    for _ in range(count):
        per_table = lengths.view(tables, batch_size).sum(1).tolist()
        values = torch.cat(
            [torch.randint(0, r, (n,), generator=gen) for r, n in zip(table_rows(shape), per_table)]
        )
        sparse = KeyedJaggedTensor([f"f{i}" for i in range(tables)], values, lengths.clone())
        dense = torch.randn(batch_size, shape["num_dense"], generator=gen)
        labels = torch.randint(0, 2, (batch_size,), generator=gen).float()
        out.append(Batch(dense, sparse, labels))
    return out


def build_tables(shape: dict) -> list[TableConfig]:
    return [
        TableConfig(f"t{i}", rows, shape["embedding_dim"], feature_names=(f"f{i}",))
        for i, rows in enumerate(table_rows(shape))
    ]


def selected_backends(backends: str, results: dict) -> list[str]:
    """The backends to time; unavailable ones are recorded as skipped in ``results``."""
    chosen = []
    for backend in (b.strip() for b in backends.split(",") if b.strip()):
        if backend == "fbgemm" and not fbgemm_available():
            results["towerrec_fbgemm"] = {"skipped": "fbgemm_gpu is not installed"}
        else:
            chosen.append(backend)
    return chosen


def shape_inputs(shape: dict, batch_size: int) -> tuple[Config, DataSchema]:
    """The default config and a schema for a DLRM of ``shape`` at ``batch_size``."""
    config = load_config(
        overrides=[
            f"model.embedding_dim={shape['embedding_dim']}",
            f"model.bottom_mlp={list(shape['bottom_mlp'])}",
            f"model.top_mlp={list(shape['top_mlp'])}",
            f"train.batch_size={batch_size}",
        ]
    )
    schema = DataSchema(
        shape["num_dense"],
        tuple(
            SparseFeature(f"f{i}", rows, factor)
            for i, (rows, factor) in enumerate(zip(table_rows(shape), pooling_factors(shape)))
        ),
    )
    return config, schema


def default_choices(shape: dict, batch_size: int) -> dict[str, Choice]:
    """What ``towerrec train`` at its defaults picks for a DLRM of ``shape``: the
    embedding kernel (``embedding.backend = auto``: measured, or read from the choice
    cache) and the precision (``train.precision``'s default, resolved when ``auto``)."""
    config, schema = shape_inputs(shape, batch_size)
    resolved, choices = resolve_choices(config, schema, torch.device("cpu"))
    backend = choices.get("backend") or Choice(resolved.embedding.backend.value, "forced", "")
    precision = choices.get("precision") or Choice(resolved.train.precision, "forced", "")
    return {"backend": backend, "precision": precision}


def _towerrec_row(shape: dict, backend: str) -> tuple[DLRM, torch.optim.Optimizer]:
    ebc = EmbeddingBagCollection(
        build_tables(shape), EmbeddingOptimizerConfig(lr=EMB_LR), backend=backend
    )
    torch.manual_seed(0)
    model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"])
    # towerrec's dense optimizer (build/optimizers.py), at the peers' settings
    optimizer = Adam([p for _, p in dense_parameters(model)], lr=DENSE_LR, fused=True)
    return model, optimizer


Measure = Callable[[torch.dtype, Callable[[], float]], Roofline]
# (layers, batch, dtype) -> seconds of the step's linear-layer matmuls, each alone
MeasureMatmuls = Callable[[Sequence[tuple[int, int, bool]], int, torch.dtype], float]


def _measure(dtype: torch.dtype, clock: Callable[[], float]) -> Roofline:
    return measure_roofline("cpu", dtype, 1.0, clock)


def _measure_matmuls(
    layers: Sequence[tuple[int, int, bool]], batch: int, dtype: torch.dtype
) -> float:
    return layer_matmul_seconds(layers, batch, dtype)


def dlrm_layers(model: DLRM) -> list[tuple[int, int, bool]]:
    """The DLRM's linear layers, bottom MLP then top: ``(in, out, input_grad)``, the
    bottom MLP's first without its input's gradient (the dense features need none)."""
    layers = []
    for mlp, first_grad in ((model.bottom, False), (model.top, True)):
        linears = [m for m in (mlp or ()) if isinstance(m, torch.nn.Linear)]
        layers += [
            (m.in_features, m.out_features, i > 0 or first_grad) for i, m in enumerate(linears)
        ]
    return layers


def _best(a: Roofline, b: Roofline) -> Roofline:
    """Each peak the higher of two measurements (a short one can land in a slow moment)."""
    return Roofline(
        a.device, a.dtype, max(a.matmul_flops, b.matmul_flops), max(a.bandwidth, b.bandwidth)
    )


@keeps_process_settings
def run_train_benchmark(
    steps: int = 30,
    warmup: int = 5,
    backends: str = "torch,fbgemm",
    torchrec: bool = True,
    batch_size: int = 2048,
    shape: dict | None = None,
    plain: bool = True,
    rounds: int = 5,
    threads: int | None = None,
    precisions: Sequence[str] = ("fp32",),
    default_row: bool = True,
    profile_steps: int = 0,
    measure: Measure = _measure,
    measure_matmuls: MeasureMatmuls = _measure_matmuls,
) -> dict:
    """Every row trained on the same batches, round-robin; each row's roofline at its
    precision and ratios against TorchRec's fastest configuration and against the fastest
    peer (``train_report.py``). Rows: ``towerrec_<backend>[_<precision>]`` per forced
    backend and precision, ``towerrec_default`` (``default_choices``: what the target is
    judged on), and the peers at each precision (``_bf16``: the dense part under bf16
    autocast, as for towerrec's rows): TorchRec under DMP and without it (``torchrec``),
    and the plain PyTorch DLRM with one ``nn.EmbeddingBag`` for every table or one per
    table (``plain``, ``plain_dlrm.py``). ``measure(dtype, clock)``: the roofline's peaks
    (a test passes fake ones); ``measure_matmuls(layers, batch, dtype)``: the seconds of
    the step's linear-layer matmuls, each alone (the shapes' bound, ``train_report.py``);
    ``profile_steps``: each towerrec row's phase table
    (``train_profile.py``) over that many steps after the timing."""
    set_threads(threads)
    unknown = sorted(set(precisions) - set(PRECISION_DTYPES))
    if unknown or not precisions:
        raise ValueError(
            f"--precisions {','.join(unknown)} unknown; choose from {', '.join(PRECISION_DTYPES)}"
        )
    shape = dict(shape or CRITEO_SHAPE)
    batches = make_batches(shape, batch_size)
    results: dict[str, dict] = {}
    systems: dict[str, Callable[..., object]] = {}
    models: dict[str, tuple[DLRM, torch.optim.Optimizer, torch.dtype | None]] = {}
    rows: dict[str, dict[str, Any]] = {}  # what each row runs
    train_flops = 0
    layers: list[tuple[int, int, bool]] = []
    named = [
        (_row_name(f"towerrec_{b}", p), b, p)
        for b in selected_backends(backends, results)
        for p in precisions
    ]
    choices: dict[str, Choice] = {}
    if default_row:
        choices = default_choices(shape, batch_size)
        named.append((DEFAULT_ROW, choices["backend"].value, choices["precision"].value))
    for name, backend, precision in named:
        model, optimizer = _towerrec_row(shape, backend)
        dtype = autocast_dtype(precision)
        train_flops = 3 * model.flops_per_sample()  # forward + backward (2x) of the dense part
        layers = dlrm_layers(model)
        models[name] = (model, optimizer, dtype)
        rows[name] = {"backend": backend, "precision": precision}
        systems[name] = lambda i, m=model, o=optimizer, d=dtype: train_step(
            m, o, batches[i % len(batches)], d
        )
    use_torchrec = torchrec and torchrec_available()
    if torchrec and not use_torchrec:
        results["torchrec"] = {"skipped": "torchrec is not installed"}
    with single_process_group() if use_torchrec else contextlib.nullcontext():
        if use_torchrec:
            quiet_torchrec_logs()
            trec_batches = [(b.dense, b.sparse.to_torchrec(), b.labels) for b in batches]
            dims = (
                shape["num_tables"],
                table_rows(shape),
                shape["embedding_dim"],
                shape["num_dense"],
                shape["bottom_mlp"],
                shape["top_mlp"],
                EMB_LR,
                DENSE_LR,
            )
            for (name, build), p in itertools.product(
                (("torchrec", torchrec_dlrm), ("torchrec_no_dmp", torchrec_dlrm_fused)),
                precisions,
            ):
                trec_model, trec_opt = build(*dims)
                dtype = autocast_dtype(p)
                rows[_row_name(name, p)] = {"backend": "torchrec (fbgemm)", "precision": p}
                systems[_row_name(name, p)] = lambda i, m=trec_model, o=trec_opt, d=dtype: (
                    torchrec_step(m, o, trec_batches[i % len(trec_batches)], d)
                )
        if plain:
            for fused, p in itertools.product((True, False), precisions):
                peer, peer_opts = plain_dlrm(shape, torch.device("cpu"), fused, EMB_LR, DENSE_LR)
                name = _row_name("plain_fused" if fused else "plain_per_table", p)
                kind = (
                    "one nn.EmbeddingBag for all tables" if fused else "nn.EmbeddingBag per table"
                )
                dtype = autocast_dtype(p)
                rows[name] = {"backend": f"plain PyTorch ({kind})", "precision": p}
                systems[name] = lambda i, m=peer, o=peer_opts, d=dtype: plain_step(
                    m, o, batches[i % len(batches)], d
                )
        used = sorted({r["precision"] for r in rows.values()}, key=list(PRECISION_DTYPES).index)
        clocks = {"wall": time.perf_counter, "cpu": time.process_time}
        roofs = {(p, c): measure(PRECISION_DTYPES[p], clocks[c]) for p in used for c in clocks}
        layers = layers or dlrm_layers(_towerrec_row(shape, "torch")[0])  # no towerrec row
        matmuls = {p: measure_matmuls(layers, batch_size, PRECISION_DTYPES[p]) for p in used}
        cpu_seconds: dict[str, float] = {}
        seconds = time_interleaved(
            systems, rounds, max(steps // rounds, 1), warmup, cpu_seconds=cpu_seconds
        )
        roofs = {
            (p, c): _best(r, measure(PRECISION_DTYPES[p], clocks[c])) for (p, c), r in roofs.items()
        }
        matmuls = {  # the lesser of two, as the peaks the greater
            p: min(s, measure_matmuls(layers, batch_size, PRECISION_DTYPES[p]))
            for p, s in matmuls.items()
        }
    work = StepWork(
        train_flops * batch_size, batch_embedding_bytes(batches, shape["embedding_dim"])
    )
    for name, s in seconds.items():
        precision = rows[name]["precision"]
        results[name] = {
            **rows[name],
            "samples_per_s": round(batch_size / s, 1),
            "step_ms": round(s * 1e3, 3),
            "cpu_ms_per_step": round(cpu_seconds[name] * 1e3, 3),
            **roofline_fields(
                work,
                s,
                cpu_seconds[name],
                roofs[precision, "wall"],
                roofs[precision, "cpu"],
                matmuls[precision],
            ),
        }
    if choices:
        results[DEFAULT_ROW]["chosen"] = {k: c.as_dict() for k, c in choices.items()}
    header = add_peer_ratios(results)
    out: dict[str, Any] = {
        "benchmark": "train",
        "machine": {
            **machine_info(),
            "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(VECTOR_FLAG_PREFIXES)),
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "native_lanes": native_lanes(),
        },
        "shape": {**shape, "batch_size": batch_size},
        "steps": steps,
        "rounds": rounds,
        "rooflines": {p: {c: roofs[p, c].as_dict() for c in clocks} for p in used},
        "shapes_matmul_ms": {p: round(matmuls[p] * 1e3, 3) for p in used},
        "train_flops_per_step": work.flops,
        "embedding_bytes_per_step": round(work.embedding_bytes),
        "results": results,
        **header,
        "default_row": DEFAULT_ROW if default_row else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if profile_steps:
        out["profile"] = {
            name: profile_step(model, optimizer, batches, profile_steps, dtype)
            for name, (model, optimizer, dtype) in models.items()
        }
    return out


def _row_name(name: str, precision: str) -> str:
    """A row's name: the system's, with ``_<precision>`` unless fp32."""
    return name if precision == "fp32" else f"{name}_{precision}"


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments ``bench train`` and ``bench embedding`` share."""
    parser.add_argument("--steps", type=int, default=30, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument(
        "--backends", default="torch,fbgemm", help="comma-separated kernel backends to time"
    )
    parser.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparison")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_timing_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: towerrec's step against a plain PyTorch DLRM and the step's "
        "roofline (bench/device_train.py)",
    )
    parser.add_argument(
        "--peer",
        choices=("torchrec", "plain"),
        default=None,
        help="the step's peers: TorchRec and a plain PyTorch DLRM (the default on the CPU), or "
        "the plain PyTorch DLRM alone (the default off it; --device cpu --peer plain runs the "
        "GPU comparison's code here)",
    )
    parser.add_argument(
        "--no-plain",
        action="store_true",
        help="skip the plain PyTorch DLRM rows of the CPU run",
    )
    parser.add_argument(
        "--precisions",
        default=None,
        help="comma-separated precisions of the forced-backend rows (fp32, bf16); default: "
        "fp32 against TorchRec, fp32,bf16 with --peer plain",
    )
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="criteo_kaggle",
        help="the DLRM's shape: Criteo-Kaggle's, or the planted data's (towerrec train's default)",
    )
    parser.add_argument(
        "--no-default-row",
        action="store_true",
        help="skip the towerrec_default row (embedding.backend and train.precision as "
        "towerrec train resolves them)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the timing, profile each towerrec row over STEPS steps (torch.profiler): "
        "milliseconds per step by phase and the top operators",
    )


def _run(args: argparse.Namespace) -> dict:
    if args.device != "cpu" or args.peer == "plain":
        if args.peer == "torchrec":
            raise ValueError(f"--device {args.device} compares with --peer plain, not torchrec")
        set_threads(args.threads)
        backends = "auto" if args.backends == "torch,fbgemm" else args.backends
        shape = SHAPES[args.shape]
        return run_device_train_benchmark(
            args.device,
            shape,
            build_tables(shape),
            make_batches(shape, args.batch_size),
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            backends=backends,
            precisions=comma_list(args.precisions or ",".join(PRECISIONS)),
            lr=(EMB_LR, DENSE_LR),
        )
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0 steps, got {args.profile}")
    return run_train_benchmark(
        steps=args.steps,
        warmup=args.warmup,
        backends=args.backends,
        torchrec=not args.no_torchrec,
        batch_size=args.batch_size,
        shape=SHAPES[args.shape],
        plain=not args.no_plain,
        threads=args.threads,
        rounds=args.rounds,
        precisions=comma_list(args.precisions or "fp32"),
        default_row=not args.no_default_row,
        profile_steps=args.profile,
    )


BENCHMARK = Benchmark("training throughput on the Criteo-Kaggle-shaped DLRM", _add_arguments, _run)
