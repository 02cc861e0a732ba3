"""The settings ``auto`` leaves to the machine, chosen by measurement: the embedding
kernel (``embedding.backend``) and the dense part's precision (``train.precision``).

::

    config (auto) ──► forced value?  ── yes ──► kept
                      │ no
                      ▼
                 one candidate? (what the hardware and the settings allow) ── yes ──► it
                      │ no
                      ▼
                 choices.json holds this machine + workload? ── yes ──► its choice
                      │ no
                      ▼
                 time a few steps of each candidate, keep the faster, write it down

- Kernel: the candidates are the kernels that support the run's settings
  (``modules/kernel_timing.py``'s ``supported_backends``: FBGEMM needs fbgemm_gpu, its
  kernel for the optimizer on the device and dims that are multiples of 4); the
  workload is the run's tables (rows, dim, pooling factor), batch per rank, pooling,
  optimizer, device, intra-op threads, model and precision; a training step of the run's
  model at the run's precision (resolved first, below) on each kernel (forward, and the
  backward with the fused update) is timed, with tables of
  the workload's timed rows (``MAX_ROWS`` in all at most) and the run's dense part,
  round-robin as the precision timing below (``time_backend_steps``): the lookup alone
  can rank the kernels the other way round from the whole step. Where the two fastest
  come within ``CLOSE_CALL`` (5 %), the timing is taken once more and each kernel's
  faster step of the two counts. Compact
  tables (``embedding.kind`` other than ``full``) keep the rule of
  ``modules/kernels/backend.py`` (their kernels' tables are not the data's).
- Precision: bf16 is a candidate only where the device has bf16 units
  (``towerrec.hardware.bf16_units``: AMX, AVX-512 BF16 or AArch64's BF16 on a CPU, a CUDA GPU with
  bf16); elsewhere fp32 without timing. The workload is the run's model with small
  tables (its dense part is the run's) at the batch per rank; forward and backward
  steps in fp32 and under bf16 autocast are timed round-robin, ``PRECISION_BLOCK`` steps of
  one precision in a row (at least ``PRECISION_ROUNDS`` rounds and ``PRECISION_TIMED_S`` of
  them), and bf16 is chosen unless fp32's step is the faster by more than
  ``BF16_MIN_SPEEDUP`` allows (a tie takes bf16). Tables and optimizer
  states keep their precision; autocast is the only source of bf16
  (``train/numerics.py`` pins IEEE fp32 matmuls).
- With ``TOWERREC_MEASURE=0`` nothing is timed: the kernel follows the rule, the
  precision is fp32 (deterministic; the test suite sets it).

The choice is logged with its reason and the measured times, and written into the
run's resolved config (``config.toml``), so that ``--resume`` keeps it. In a
distributed run rank 0 measures or reads the cache and broadcasts the choice, so every
rank runs the same kernel and precision. Each measurement stops starting timed rounds
after ``BUDGET_S`` (1 s) of wall time, so a busy machine does not stretch it; on a quiet
one it takes well under a second (building the timed tables included; the first use
of FBGEMM also pays its library's import, which the run would pay anyway). The cache
(``choice_cache.py``) makes it once per machine and workload.

A timing taken in a busy moment is used by its run but not cached
(``kernel_timing.TimingStats.noise``): when the process ran less than 0.7 CPU seconds
per wall second of its timed rounds (other processes held the cores), or when a
candidate's median step took more than 1.5x its fastest (the rounds disagree). The
reason is logged and given in the choice's ``why``; the next run measures again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from towerrec.build.choice_cache import ChoiceCache
from towerrec.build.models import build_model, build_tables
from towerrec.build.ranks import on_first_rank
from towerrec.build.towers import LEARNED_PARTITIONS
from towerrec.config import Config, EmbeddingConfig, ModelConfig
from towerrec.data.batch import Batch, DataSchema
from towerrec.hardware import bf16_units, machine_key
from towerrec.modules.kernel_timing import (
    BUDGET_S,
    KernelWorkload,
    TimingStats,
    supported_backends,
)
from towerrec.modules.kernels import Backend, resolve_backend
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.step import autocast, autocast_dtype

__all__ = [
    "BF16_MIN_SPEEDUP",
    "CLOSE_CALL",
    "MEASURE_ENV",
    "PRECISION_BLOCK",
    "Choice",
    "TimingRounds",
    "choose_backend",
    "choose_precision",
    "kernel_workload",
    "measuring",
    "resolve_choices",
    "time_backend_steps",
    "with_recorded_choices",
]

log = logging.getLogger("towerrec")

MEASURE_ENV = "TOWERREC_MEASURE"
# bf16 is chosen where fp32's timed dense step exceeds this multiple of bf16's: a tie, and
# bf16 up to 3 % slower, take bf16. The timing (the fastest round, one batch over and over,
# no optimizer step) sees the machine at its quietest, where fp32's twice larger activations
# cost least, and understates what bf16 gains in training. On the planted model at two
# threads (machine B: 2-core AMD EPYC, avx512_bf16) it put fp32/bf16 anywhere in 0.90-1.02
# over six timings, a coin toss, while `bench train`'s whole steps ran bf16 1.01-1.05x
# faster in the machine's fast state and 1.20-1.27x in its slow one (memory shared with
# other tenants); at one thread it timed 1.02-1.08 against whole steps' 1.08-1.10. Margins
# the other way (1.05, then 1.0) kept fp32 at 0.83-0.92 of the best forced row. bf16's AUC
# is within noise of fp32's (docs/benchmarks.md, bench precision).
BF16_MIN_SPEEDUP = 0.97
# The kernel timing of a run whose two fastest kernels came within this factor is taken once
# more, each kernel's step the faster of its two: one timing of the planted model at two
# threads in a busy moment put FBGEMM 3 % ahead (3.41 against 3.52 ms), while the same run's
# whole training steps ran the torch kernel 1.25x faster (0.81 of the best forced row).
# Fresh processes otherwise timed FBGEMM/torch at 1.11-1.40 (eight timings).
CLOSE_CALL = 1.05
# Rounds of the precision timing: at least PRECISION_ROUNDS, and more until PRECISION_TIMED_S
# of timed wall time (at most PRECISION_MAX_ROUNDS): on a 2-core machine five rounds of a
# small model's ~4 ms step put the fp32/bf16 ratio anywhere in 0.94-1.18, forty in 0.99-1.02.
PRECISION_ROUNDS, PRECISION_MAX_ROUNDS, PRECISION_TIMED_S = 5, 40, 0.3
# Steps of one precision in a row within a round, timed together: training runs one
# precision step after step, and alternating them every step hides part of what fp32's
# larger activations cost (measured: 1.04x against the whole step's 1.10-1.16x on the
# planted model at one thread)
PRECISION_BLOCK = 4
TIMING_ROWS = 64  # rows per table of the model whose dense part the precision timing runs


@dataclass(frozen=True)
class Choice:
    """One resolved setting: its ``value``, ``how`` it was reached (``forced``, ``only``,
    ``rule``, ``cached``, ``measured``), why, and the seconds per step measured (now or
    when cached) for each candidate."""

    value: str
    how: str
    why: str
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    took_s: float = 0.0  # the measurement's own wall time (0 when nothing was timed)

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "how": self.how,
            "why": self.why,
            "ms_per_step": {k: round(v * 1e3, 3) for k, v in self.seconds.items()},
            "took_s": round(self.took_s, 3),
        }

    def describe(self) -> str:
        times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.seconds.items())
        return f"{self.value} ({self.how}: {self.why}{'; ' + times if times else ''})"


def measuring() -> bool:
    """Whether ``auto`` settings are timed (``TOWERREC_MEASURE`` unset or not ``0``)."""
    return os.environ.get(MEASURE_ENV, "1").strip() != "0"


def _pick(
    kind: str,
    device: torch.device,
    workload: dict,
    candidates: list[str],
    measure: Callable[[TimingStats], dict[str, float]],
    decide: Callable[[dict[str, float]], str],
    cache: ChoiceCache,
) -> Choice:
    machine = machine_key(device)
    workload = json.loads(json.dumps(workload))  # as the file holds it (lists, not tuples)
    entry = cache.lookup(kind, machine, workload, candidates)
    if entry is not None:
        return Choice(entry["choice"], "cached", f"measured {entry['measured']}", entry["seconds"])
    start, stats = time.perf_counter(), TimingStats()
    seconds = measure(stats)
    took = time.perf_counter() - start
    choice = decide(seconds)
    noise = stats.noise()
    if noise is not None:  # a busy moment: good enough for this run, not for later ones
        log.info(
            "the %s timing was noisy (%s): %s holds for this run and is not cached; "
            "the next run measures again",
            kind,
            noise,
            choice,
        )
        why = f"timed in {took:.2f} s, not cached: {noise}"
        return Choice(choice, "measured", why, seconds, took)
    cache.store(kind, machine, workload, choice, seconds)
    return Choice(choice, "measured", f"timed in {took:.2f} s", seconds, took)


# ------------------------------------------------------------------ kernel
def kernel_workload(
    config: Config, schema: DataSchema, device: torch.device, batch: int
) -> KernelWorkload:
    tables = build_tables(config, schema)
    factors = {f.name: f.pooling_factor for f in schema.sparse}
    return KernelWorkload(
        tuple(t.num_embeddings for t in tables),
        tuple(t.embedding_dim for t in tables),
        tuple(factors[t.name] for t in tables),
        batch,
        config.embedding.pooling,
        config.embedding.optimizer_config(),
        str(device),
    )


def choose_backend(
    config: Config,
    schema: DataSchema,
    device: torch.device,
    batch: int,
    cache: ChoiceCache,
    precision: str = "fp32",
) -> Choice:
    """``embedding.backend`` resolved for this run (module doc), its steps timed at the
    run's resolved ``precision``."""
    emb = config.embedding
    if emb.backend is not Backend.AUTO:
        return Choice(emb.backend.value, "forced", "embedding.backend")
    workload = kernel_workload(config, schema, device, batch)
    rule = resolve_backend(Backend.AUTO, device, emb.optimizer, workload.dims, emb.weight_decay)
    if not emb.compact().is_full:  # each compact table's kernel resolved when it is built,
        # from its own dims (e.g. mixed-dim tables whose dims FBGEMM cannot take)
        return Choice(
            Backend.AUTO.value, "rule", "compact tables (their kernels' tables are not the data's)"
        )
    candidates = [b.value for b in supported_backends(workload)]
    if len(candidates) == 1:
        return Choice(candidates[0], "only", "the one kernel for these settings")
    if not measuring():
        return Choice(rule.value, "rule", f"{MEASURE_ENV}=0")

    def timing(stats: TimingStats) -> dict[str, float]:
        backends = [Backend(c) for c in candidates]
        seconds = time_backend_steps(
            workload, backends, config=config, schema=schema, stats=stats,
            dtype=autocast_dtype(precision),
        )  # fmt: skip
        return {b.value: s for b, s in seconds.items()}

    def measure(stats: TimingStats) -> dict[str, float]:
        seconds = timing(stats)
        first, second = sorted(seconds.values())[:2]
        if second < CLOSE_CALL * first:  # a close call: the fastest step of both timings
            log.info(
                "embedding.backend timing within %d %% (%s): timed again",
                round((CLOSE_CALL - 1) * 100),
                ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in seconds.items()),
            )
            again = timing(stats)
            seconds = {name: min(s, again[name]) for name, s in seconds.items()}
        return seconds

    key = {  # the whole step is timed: its model is part of the workload
        **workload.describe(),
        "model": dataclasses.asdict(_fixed_partition(config)),
        "num_dense": schema.num_dense,
        "threads": torch.get_num_threads(),
        "precision": precision,
    }
    return _pick(
        "backend", device, key, candidates, measure, lambda s: min(s, key=s.__getitem__), cache
    )


# ------------------------------------------------------------------ precision
def _fixed_partition(config: Config) -> ModelConfig:
    """The run's model with a DMT's learned partition replaced by a fixed one (a timing
    has no pilot run to learn it from)."""
    model = config.model
    if model.dmt.partition in LEARNED_PARTITIONS:
        model = dataclasses.replace(
            model, dmt=dataclasses.replace(model.dmt, partition="contiguous")
        )
    return model


def _timing_inputs(config: Config, schema: DataSchema) -> tuple[Config, DataSchema]:
    """The run's config and schema with small full tables (the dense part unchanged) and a
    DMT's learned partition replaced by a fixed one (no pilot run to time)."""
    small = DataSchema(
        schema.num_dense,
        tuple(
            dataclasses.replace(f, num_embeddings=min(f.num_embeddings, TIMING_ROWS))
            for f in schema.sparse
        ),
    )
    emb = config.embedding
    embedding = EmbeddingConfig(
        backend=Backend.TORCH, optimizer=emb.optimizer, lr=emb.lr, pooling=emb.pooling
    )
    return dataclasses.replace(config, embedding=embedding, model=_fixed_partition(config)), small


def _random_batch(
    schema: DataSchema, batch: int, device: torch.device, gen: torch.Generator
) -> Batch:
    lengths, values = [], []
    for f in schema.sparse:
        ends = torch.floor(torch.arange(batch + 1, dtype=torch.float64) * f.pooling_factor).long()
        per_bag = ends.diff()
        lengths.append(per_bag)
        values.append(torch.randint(0, f.num_embeddings, (int(per_bag.sum()),), generator=gen))
    sparse = KeyedJaggedTensor(schema.sparse_names, torch.cat(values), torch.cat(lengths))
    dense = torch.randn(batch, schema.num_dense, generator=gen)
    labels = torch.randint(0, 2, (batch,), generator=gen).float()
    return Batch(dense, sparse, labels).to(device)


@dataclass(frozen=True)
class TimingRounds:
    """How a round-robin timing runs (``time_precisions``, ``time_backend_steps``)."""

    steps: int = PRECISION_ROUNDS  # rounds at least
    warmup: int = 1  # untimed rounds first
    timed_s: float = PRECISION_TIMED_S  # then rounds until this much timed wall time
    max_steps: int = PRECISION_MAX_ROUNDS
    block: int = PRECISION_BLOCK  # consecutive steps of one candidate, timed together
    budget_s: float = BUDGET_S  # no new round after this much timed wall time


def _round_robin(
    candidates: dict[str, Callable[[], None]],
    device: torch.device,
    rounds: TimingRounds,
    stats: TimingStats | None,
    now: Callable[[], float],
) -> dict[str, float]:
    """Seconds of one step of each candidate: the fastest of the timed rounds, taken
    round-robin after ``rounds.warmup`` rounds (the first steps of a process are slower:
    allocation, packing); a round times ``rounds.block`` consecutive steps of each
    candidate together (training runs one setting step after step). At least
    ``rounds.steps`` rounds, then more until ``rounds.timed_s`` of them (at most
    ``rounds.max_steps``); no new round after ``rounds.budget_s`` (``BUDGET_S``; wall
    seconds by ``now``).
    With one intra-op thread on a CPU the clock is the process's CPU time."""
    one_thread_cpu = torch.get_num_threads() == 1 and device.type == "cpu"
    clock = time.process_time if one_thread_cpu else time.perf_counter

    def step(one: Callable[[], None]) -> float:
        """Seconds a step over ``block`` consecutive steps of one candidate."""
        start = clock()
        for _ in range(rounds.block):
            one()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (clock() - start) / rounds.block

    best = {name: math.inf for name in candidates}
    for _ in range(rounds.warmup):
        for one in candidates.values():
            step(one)
    begin, cpu_begin = now(), time.process_time()
    for done in range(1, max(rounds.steps, rounds.max_steps) + 1):
        for name, one in candidates.items():
            seconds = step(one)
            best[name] = min(best[name], seconds)
            if stats is not None:
                stats.add_step(name, seconds)
        elapsed = now() - begin
        if elapsed > rounds.budget_s or (done >= rounds.steps and elapsed >= rounds.timed_s):
            break  # enough rounds, or a busy machine: what we have
    if stats is not None:
        stats.wall_s += now() - begin
        stats.cpu_s += time.process_time() - cpu_begin
    return best


def _training_step(
    model: torch.nn.Module, data: Batch, device: torch.device, dtype: torch.dtype | None
) -> Callable[[], None]:
    """One forward and backward of ``model`` on ``data`` (the embedding update fused into
    the backward; the dense gradients dropped)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def one() -> None:
        with autocast(device, dtype):
            logits = model(data.dense, data.sparse)
        loss = F.binary_cross_entropy_with_logits(logits.float(), data.labels)
        loss.backward()
        for p in params:
            p.grad = None

    return one


def time_precisions(
    config: Config,
    schema: DataSchema,
    device: torch.device,
    batch: int,
    steps: int = PRECISION_ROUNDS,
    warmup: int = 1,
    stats: TimingStats | None = None,
    timed_s: float = PRECISION_TIMED_S,
    max_steps: int = PRECISION_MAX_ROUNDS,
    now: Callable[[], float] = time.perf_counter,
    block: int = PRECISION_BLOCK,
) -> dict[str, float]:
    """Seconds of one forward and backward of the run's model (small tables) in fp32 and
    under bf16 autocast, timed round-robin (``_round_robin``: ``steps`` rounds at least,
    ``block`` steps of one precision in a row, ``PRECISION_BLOCK``). ``stats``, when
    given, receives the timed rounds' wall and CPU seconds and steps."""
    small_config, small_schema = _timing_inputs(config, schema)
    with torch.random.fork_rng(devices=[]):
        model = build_model(small_config, small_schema, device)
        gen = torch.Generator().manual_seed(0)
        data = _random_batch(small_schema, batch, device, gen)
    candidates = {
        "fp32": _training_step(model, data, device, None),
        "bf16": _training_step(model, data, device, torch.bfloat16),
    }
    rounds = TimingRounds(steps, warmup, timed_s, max_steps, block)
    return _round_robin(candidates, device, rounds, stats, now)


def _kernel_timing_inputs(
    config: Config, schema: DataSchema, workload: KernelWorkload, backend: Backend
) -> tuple[Config, DataSchema]:
    """The run's config on ``backend`` and its schema with each table at its timed rows
    (``KernelWorkload.timed_rows``: all of them up to ``MAX_ROWS`` in all), tables in
    memory, a DMT's learned partition replaced by a fixed one (no pilot run to time)."""
    rows = workload.timed_rows()  # one table per feature (``build_tables``), in order
    timed = DataSchema(
        schema.num_dense,
        tuple(
            dataclasses.replace(f, num_embeddings=r)
            for f, r in zip(schema.sparse, rows, strict=True)
        ),
    )
    emb = config.embedding
    embedding = EmbeddingConfig(
        backend=backend,
        optimizer=emb.optimizer,
        lr=emb.lr,
        eps=emb.eps,
        pooling=emb.pooling,
        adam_betas=emb.adam_betas,
        counter_halflife=emb.counter_halflife,
        weight_decay=emb.weight_decay,
        weight_decay_mode=emb.weight_decay_mode,
    )
    return dataclasses.replace(config, embedding=embedding, model=_fixed_partition(config)), timed


def time_backend_steps(
    workload: KernelWorkload,
    backends: list[Backend],
    *,
    config: Config,
    schema: DataSchema,
    stats: TimingStats | None = None,
    rounds: TimingRounds = TimingRounds(),
    now: Callable[[], float] = time.perf_counter,
    dtype: torch.dtype | None = None,
) -> dict[Backend, float]:
    """Seconds of one training step (forward, and backward with the fused embedding
    update) of the run's model on each kernel in ``backends``, under ``dtype`` autocast
    (None: fp32): the run's dense part and tables of ``workload``'s timed rows
    (``_kernel_timing_inputs``), random ids and features at the batch per rank, timed
    round-robin (``_round_robin``). The whole step, not the lookup alone: on the planted
    model at one thread (2-core AMD EPYC) the lookups alone timed FBGEMM 4-7 % faster
    while whole steps ran the torch kernel 3-7 % faster. At the run's precision: on the
    Criteo-Kaggle shape at two threads (the same machine) the torch kernel's step was
    3-5 % faster in fp32 and 4-8 % in bf16, whose faster dense part leaves the lookup a
    larger share."""
    device = torch.device(workload.device)
    candidates = {}
    for backend in backends:
        timed_config, timed_schema = _kernel_timing_inputs(config, schema, workload, backend)
        with torch.random.fork_rng(devices=[]):
            model = build_model(timed_config, timed_schema, device)
            data = _random_batch(
                timed_schema, workload.batch_size, device, torch.Generator().manual_seed(0)
            )
        candidates[backend.value] = _training_step(model, data, device, dtype)
    seconds = _round_robin(candidates, device, rounds, stats, now)
    return {Backend(name): s for name, s in seconds.items()}


def choose_precision(
    config: Config, schema: DataSchema, device: torch.device, batch: int, cache: ChoiceCache
) -> Choice:
    """``train.precision`` resolved for this run (module doc)."""
    if config.train.precision != "auto":
        return Choice(config.train.precision, "forced", "train.precision")
    units = bf16_units(device)
    if units is None:
        what = (
            "this GPU"
            if device.type == "cuda"
            else "this CPU (no amx_bf16, avx512_bf16 or AArch64 bf16)"
        )
        return Choice("fp32", "only", f"no bf16 units on {what}")
    if not measuring():
        return Choice("fp32", "rule", f"{MEASURE_ENV}=0")
    workload = {
        "model": dataclasses.asdict(_timing_inputs(config, schema)[0].model),
        "num_dense": schema.num_dense,
        "features": [[f.name, round(f.pooling_factor, 3)] for f in schema.sparse],
        "batch_size": batch,
        "threads": torch.get_num_threads(),
        "bf16_units": units,
    }

    def decide(seconds: dict[str, float]) -> str:
        return "bf16" if seconds["fp32"] > BF16_MIN_SPEEDUP * seconds["bf16"] else "fp32"

    return _pick(
        "precision",
        device,
        workload,
        ["fp32", "bf16"],
        lambda stats: time_precisions(config, schema, device, batch, stats=stats),
        decide,
        cache,
    )


# ------------------------------------------------------------------ the run
def resolve_choices(
    config: Config,
    schema: DataSchema,
    device: torch.device,
    world_size: int = 1,
    cache: ChoiceCache | None = None,
) -> tuple[Config, dict[str, Choice]]:
    """``config`` with ``embedding.backend`` and ``train.precision`` resolved (module
    doc), and the choices made (logged); a no-op for settings that are not ``auto``.
    ``world_size``: the run's processes (the batch per rank is the timed one)."""
    if config.embedding.backend is not Backend.AUTO and config.train.precision != "auto":
        return config, {}
    batch = max(1, config.train.batch_size // max(1, world_size))

    def compute() -> dict[str, Choice]:
        store = cache if cache is not None else ChoiceCache()
        # the precision first (its timing runs small tables on the torch kernel): the
        # kernels are then timed at the precision the run trains in
        precision = choose_precision(config, schema, device, batch, store)
        return {
            "backend": choose_backend(config, schema, device, batch, store, precision.value),
            "precision": precision,
        }

    choices = on_first_rank(compute)
    for setting, choice in (
        ("embedding.backend", choices["backend"]),
        ("train.precision", choices["precision"]),
    ):
        if choice.how != "forced":
            log.info("%s = auto: %s", setting, choice.describe())
    embedding = dataclasses.replace(config.embedding, backend=Backend(choices["backend"].value))
    train = dataclasses.replace(config.train, precision=choices["precision"].value)
    return dataclasses.replace(config, embedding=embedding, train=train), choices


def with_recorded_choices(config: Config, recorded: Config) -> Config:
    """``config`` with each ``auto`` setting replaced by ``recorded``'s resolved value (a
    resumed run keeps the kernel and precision its config.toml holds, whatever a new
    measurement would say)."""
    embedding, train = config.embedding, config.train
    if embedding.backend is Backend.AUTO and recorded.embedding.backend is not Backend.AUTO:
        embedding = dataclasses.replace(embedding, backend=recorded.embedding.backend)
    if train.precision == "auto" and recorded.train.precision != "auto":
        train = dataclasses.replace(train, precision=recorded.train.precision)
    return dataclasses.replace(config, embedding=embedding, train=train)
