"""``auto`` settings chosen by measurement (build/choices.py) and kept per machine
(build/choice_cache.py). The timings are replaced by fixed numbers, so that no test
depends on how busy the machine is; one test times the real kernels on a tiny
workload and checks only that it ran."""

import dataclasses
import json
import math
import multiprocessing as mp
import os

import pytest
import torch
from conftest import needs_fbgemm

import towerrec.build.choices as choices
from towerrec.build.choice_cache import ChoiceCache, cache_dir
from towerrec.build.choices import resolve_choices, with_recorded_choices
from towerrec.build.ranks import on_first_rank
from towerrec.config import load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.hardware import machine_key
from towerrec.modules.kernel_timing import (
    MAX_ROWS,
    KernelWorkload,
    TimingStats,
    supported_backends,
)
from towerrec.modules.kernels import Backend
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.step import autocast_dtype

CPU = torch.device("cpu")
# precision pinned: the kernel tests time nothing else (the precision tests set auto)
SMALL = ["data.synthetic.eval_samples=1000", "train.precision=fp32"]


def _config(*overrides: str):
    return load_config(overrides=[*SMALL, *overrides])


def _dim(dim: int) -> list[str]:
    return [f"model.embedding_dim={dim}", f"model.bottom_mlp=[64, {dim}]"]


def _schema(config):
    return SyntheticSource(config.data.synthetic).schema


class FakeTimer:
    """Stands in for a measurement: returns ``seconds`` and counts its calls."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.calls = seconds, 0

    def backends(self, workload, backends, **_):
        self.calls += 1
        return {b: self.seconds[b.value] for b in backends}

    def precisions(self, *args, **kwargs):
        self.calls += 1
        return dict(self.seconds)


@pytest.fixture
def measuring(monkeypatch, tmp_path, one_thread):
    """Measurement on, into a cache of the test's own."""
    monkeypatch.setenv("TOWERREC_MEASURE", "1")
    monkeypatch.setenv("TOWERREC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "choices.json"


def _fake_backends(monkeypatch, **seconds: float) -> FakeTimer:
    timer = FakeTimer(seconds)
    monkeypatch.setattr(choices, "time_backend_steps", timer.backends)
    return timer


def test_the_cache_directory_follows_the_setting_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("TOWERREC_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TOWERREC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "towerrec"


@needs_fbgemm
@pytest.mark.parametrize("faster", ["torch", "fbgemm"])
def test_auto_backend_is_the_faster_kernel_and_is_measured_once(monkeypatch, measuring, faster):
    timer = _fake_backends(monkeypatch, **{"torch": 2.0, "fbgemm": 2.0, faster: 1.0})
    config = _config()
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.embedding.backend is Backend(faster)
    assert made["backend"].how == "measured" and timer.calls == 1
    entry = next(iter(json.loads(measuring.read_text())["entries"].values()))
    assert entry["choice"] == faster and entry["machine"] == machine_key(CPU)
    again, made = resolve_choices(config, _schema(config), CPU)
    assert again.embedding.backend is Backend(faster)
    assert made["backend"].how == "cached" and timer.calls == 1  # read, not timed again


class SequenceTimer:
    """Stands in for a kernel timing that sees a different machine each time it runs:
    its calls return ``timings`` in turn."""

    def __init__(self, *timings: dict[str, float]) -> None:
        self.timings, self.calls = timings, 0

    def backends(self, workload, backends, **_):
        seconds = self.timings[self.calls]
        self.calls += 1
        return {b: seconds[b.value] for b in backends}


@needs_fbgemm
@pytest.mark.parametrize(
    ("timings", "calls", "expected"),
    [
        # a busy moment put FBGEMM 3 % ahead; timed again, the torch kernel wins
        (({"torch": 3.52, "fbgemm": 3.41}, {"torch": 2.60, "fbgemm": 3.00}), 2, "torch"),
        # still close the second time: each kernel's faster step, no third timing
        (({"torch": 1.00, "fbgemm": 1.03}, {"torch": 1.02, "fbgemm": 0.99}), 2, "fbgemm"),
        # a clear margin (1.06x) is timed once
        (({"torch": 1.00, "fbgemm": 1.06}, {"torch": 9.0, "fbgemm": 0.1}), 1, "torch"),
    ],
)
def test_a_close_kernel_timing_is_taken_again(monkeypatch, measuring, timings, calls, expected):
    timer = SequenceTimer(*timings)
    monkeypatch.setattr(choices, "time_backend_steps", timer.backends)
    config = _config()
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.embedding.backend is Backend(expected) and timer.calls == calls
    both = {name: min(t[name] for t in timings[:calls]) for name in ("torch", "fbgemm")}
    assert made["backend"].seconds == both
    entry = next(iter(json.loads(measuring.read_text())["entries"].values()))
    assert entry["choice"] == expected  # kept, as any quiet timing


@needs_fbgemm
def test_the_kernel_is_measured_again_for_another_model(monkeypatch, measuring):
    """Whole steps are timed, so the choice is kept per model as well as per tables."""
    timer = _fake_backends(monkeypatch, torch=1.0, fbgemm=2.0)
    for name in ("dlrm", "dcn", "dlrm"):
        config = _config(f"model.name={name}")
        resolve_choices(config, _schema(config), CPU)
    assert timer.calls == 2


@needs_fbgemm
def test_a_forced_backend_wins_over_the_measurement(monkeypatch, measuring):
    timer = _fake_backends(monkeypatch, torch=1.0, fbgemm=9.0)
    config = _config("embedding.backend=fbgemm", "train.precision=fp32")  # nothing left to time
    resolved, _ = resolve_choices(config, _schema(config), CPU)
    assert resolved.embedding.backend is Backend.FBGEMM and timer.calls == 0
    assert not measuring.exists()


def test_without_measurement_auto_follows_the_flag_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("TOWERREC_MEASURE", "0")
    monkeypatch.setattr(choices, "time_backend_steps", None)  # never called
    config = _config("train.precision=auto")
    resolved, _ = resolve_choices(config, _schema(config), CPU, cache=ChoiceCache(tmp_path))
    assert resolved.embedding.backend is not Backend.AUTO
    assert resolved.train.precision == "fp32"
    assert not (tmp_path / "choices.json").exists()


def test_a_kernel_that_cannot_run_the_settings_is_not_timed(monkeypatch, measuring):
    timer = _fake_backends(monkeypatch, torch=1.0, fbgemm=0.1)
    config = _config(*_dim(6))  # FBGEMM needs multiples of 4
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.embedding.backend is Backend.TORCH
    assert made["backend"].how == "only" and timer.calls == 0


@needs_fbgemm
@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "not json",
        "a list",
        "another version",
        "another machine",
        "a choice that is no candidate",
    ],
)
def test_a_damaged_or_stale_cache_is_ignored_and_rewritten(monkeypatch, measuring, damage):
    first = _fake_backends(monkeypatch, torch=2.0, fbgemm=1.0)
    config = _config()
    resolve_choices(config, _schema(config), CPU)
    good = json.loads(measuring.read_text())
    (key, entry), *_ = good["entries"].items()
    assert first.calls == 1
    if damage == "truncated":
        measuring.write_text(measuring.read_text()[:40])
    elif damage == "not json":
        measuring.write_text("fbgemm, I think\n")
    elif damage == "a list":
        measuring.write_text(json.dumps([entry]))
    elif damage == "another version":
        measuring.write_text(json.dumps({**good, "version": 99}))
    elif damage == "another machine":  # under this key, and under its own (kept)
        other = {**entry, "machine": {**entry["machine"], "cpu": "another CPU"}}
        measuring.write_text(json.dumps({**good, "entries": {key: other, "theirs": other}}))
    else:
        measuring.write_text(json.dumps({**good, "entries": {key: {**entry, "choice": "x"}}}))
    timer = _fake_backends(monkeypatch, torch=1.0, fbgemm=2.0)  # the machine changed
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert made["backend"].how == "measured" and timer.calls == 1
    assert resolved.embedding.backend is Backend.TORCH
    rewritten = json.loads(measuring.read_text())
    assert rewritten["version"] == 1 and rewritten["entries"][key]["choice"] == "torch"
    if damage == "another machine":
        assert rewritten["entries"]["theirs"]["machine"]["cpu"] == "another CPU"


def test_entries_of_other_workloads_stay(monkeypatch, measuring):
    _fake_backends(monkeypatch, torch=1.0, fbgemm=2.0)
    monkeypatch.setattr(choices, "bf16_units", lambda device: "avx512_bf16")
    monkeypatch.setattr(choices, "time_precisions", FakeTimer({"fp32": 1, "bf16": 1}).precisions)
    for dim in (6, 8, 12):
        config = _config(*_dim(dim), "train.precision=auto")
        resolve_choices(config, _schema(config), CPU)
    kinds = [e["kind"] for e in json.loads(measuring.read_text())["entries"].values()]
    assert kinds.count("precision") == 3  # one per model (the dim is part of it)
    assert kinds.count("backend") == (2 if "fbgemm" in _candidates() else 0)


def _candidates():
    workload = KernelWorkload((64,), (8,), (1.0,), 4, Pooling.SUM, EmbeddingOptimizerConfig())
    return [b.value for b in supported_backends(workload)]


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({"fp32": 2.0, "bf16": 1.0}, "bf16"),
        ({"fp32": 1.01, "bf16": 1.0}, "bf16"),
        ({"fp32": 1.0, "bf16": 1.0}, "bf16"),  # a tie takes bf16
        ({"fp32": 0.98, "bf16": 1.0}, "bf16"),  # within the timing's spread
        ({"fp32": 0.96, "bf16": 1.0}, "fp32"),
        ({"fp32": 0.5, "bf16": 1.0}, "fp32"),
    ],
)
def test_auto_precision_is_bf16_unless_fp32_times_clearly_faster(
    monkeypatch, measuring, seconds, expected
):
    monkeypatch.setattr(choices, "bf16_units", lambda device: "avx512_bf16")
    monkeypatch.setattr(choices, "time_precisions", FakeTimer(seconds).precisions)
    config = _config("train.precision=auto", "embedding.backend=torch")
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.train.precision == expected and made["precision"].how == "measured"
    assert autocast_dtype(resolved.train.precision) == (
        torch.bfloat16 if expected == "bf16" else None
    )


@pytest.mark.parametrize(
    ("timed_s", "rounds"),
    [(0.3, 5), (0.75, 8), (5.0, 11)],  # the minimum; until timed_s; the budget (1 s) stops it
)
def test_precision_timing_runs_rounds_until_its_timed_seconds(one_thread, timed_s, rounds):
    ticks = iter(range(1000))

    def now() -> float:  # 0.1 s a reading: the start, then one per round
        return 0.1 * next(ticks)

    config = _config("train.precision=auto", "embedding.backend=torch")
    stats = TimingStats()
    best = choices.time_precisions(
        config, _schema(config), CPU, 8, warmup=1, stats=stats, timed_s=timed_s, now=now
    )
    assert [len(stats.steps[p]) for p in ("fp32", "bf16")] == [rounds, rounds]
    assert best["fp32"] == min(stats.steps["fp32"]) and best["bf16"] == min(stats.steps["bf16"])


def test_precision_timing_runs_each_precision_in_blocks(one_thread, monkeypatch):
    """Each round runs ``block`` steps of one precision in a row, then of the other."""
    seen: list[bool] = []
    build = choices.build_model

    def counted(*args, **kwargs):
        model = build(*args, **kwargs)
        model.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
        return model

    monkeypatch.setattr(choices, "build_model", counted)
    ticks = iter(range(1000))
    config = _config("train.precision=auto", "embedding.backend=torch")
    stats = TimingStats()
    choices.time_precisions(
        config,
        _schema(config),
        CPU,
        8,
        warmup=1,
        stats=stats,
        now=lambda: 0.1 * next(ticks),
        block=3,
    )
    rounds = len(stats.steps["fp32"])
    assert rounds == 5 and len(stats.steps["bf16"]) == rounds
    assert seen == ([False] * 3 + [True] * 3) * (1 + rounds)  # the warmup round, then the timed


def test_auto_precision_is_fp32_without_bf16_units(monkeypatch, measuring):
    monkeypatch.setattr(choices, "bf16_units", lambda device: None)
    monkeypatch.setattr(choices, "time_precisions", None)  # never called
    config = _config("train.precision=auto", "embedding.backend=torch")
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.train.precision == "fp32" and made["precision"].how == "only"


def test_an_unresolved_precision_is_refused_by_the_step():
    with pytest.raises(ValueError, match=r"train\.precision = 'auto' is not resolved"):
        autocast_dtype("auto")
    with pytest.raises(ValueError, match=r"train\.precision"):
        load_config(overrides=["train.precision=fp16"])


def test_a_resumed_run_keeps_its_recorded_choices():
    recorded = _config("embedding.backend=torch", "train.precision=bf16")
    kept = with_recorded_choices(_config("train.precision=auto"), recorded)
    assert kept.embedding.backend is Backend.TORCH and kept.train.precision == "bf16"
    forced = with_recorded_choices(
        _config("embedding.backend=fbgemm", "train.precision=fp32"), recorded
    )
    assert forced.embedding.backend is Backend.FBGEMM and forced.train.precision == "fp32"
    default = with_recorded_choices(load_config(), recorded)  # the default precision: auto
    assert default.train.precision == "bf16"


@needs_fbgemm
def test_the_run_records_the_choice_and_a_resume_keeps_it(monkeypatch, measuring, tmp_path):
    from towerrec.workflows.training import train

    _fake_backends(monkeypatch, torch=1.0, fbgemm=2.0)
    config = _config("train.steps=2", "train.progress=false")
    summary = train(config, tmp_path / "run", stop_after=1)
    saved = load_config(base=tmp_path / "run" / "config.toml")
    assert saved.embedding.backend is Backend.TORCH and summary["backend"] == "torch"
    assert summary["auto_choices"]["backend"]["how"] == "measured"
    _fake_backends(monkeypatch, torch=2.0, fbgemm=1.0)  # a new measurement would differ
    measuring.unlink()
    resumed = train(config, tmp_path / "run", resume=True)
    assert resumed["backend"] == "torch"


def test_real_timing_of_whole_steps_gives_a_time_per_kernel(one_thread):
    """The kernel choice times the run's model, its tables at the workload's timed rows."""
    config = _config("model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "train.batch_size=16")
    schema = _schema(config)
    workload = choices.kernel_workload(config, schema, CPU, 16)
    backends = supported_backends(workload)
    inputs, timed = choices._kernel_timing_inputs(config, schema, workload, backends[-1])
    assert inputs.embedding.backend is backends[-1]
    assert [f.num_embeddings for f in timed.sparse] == workload.timed_rows()
    stats = TimingStats()
    rounds = choices.TimingRounds(steps=2, warmup=1, timed_s=0.0, max_steps=2, block=1)
    seconds = choices.time_backend_steps(
        workload, backends, config=config, schema=schema, stats=stats, rounds=rounds
    )
    assert set(seconds) == set(backends)
    assert all(0 < s < math.inf for s in seconds.values())
    assert {b.value: min(stats.steps[b.value]) for b in backends} == {
        b.value: s for b, s in seconds.items()
    }
    assert all(len(stats.steps[b.value]) == 2 for b in backends)  # two rounds, no more


def test_large_tables_are_timed_at_a_proportional_share():
    workload = KernelWorkload(
        (10_000_000, 1_000_000, 10), (16,) * 3, (1.0,) * 3, 8, Pooling.SUM,
        EmbeddingOptimizerConfig(),
    )  # fmt: skip
    big, middle, small = workload.timed_rows()
    assert small == 10 and 9 * middle <= big <= 11 * middle  # the rows' proportions
    assert big + middle <= MAX_ROWS


def _choose_on_rank(rank, world, port, directory, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["TOWERREC_MEASURE"] = "1"  # (importing conftest here turned it off)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    config = _config()
    # each rank's own cache holds another choice: only rank 0's may count
    cache = ChoiceCache(directory / str(rank))
    resolved, made = resolve_choices(config, _schema(config), CPU, world, cache=cache)
    answers = [None] * world
    dist.all_gather_object(answers, (resolved.embedding.backend.value, made["backend"].how))
    queue.put((rank, answers, on_first_rank(lambda: rank)))
    dist.destroy_process_group()


@needs_fbgemm
@pytest.mark.multiprocess
def test_every_rank_runs_rank_0s_choice(monkeypatch, measuring, tmp_path):
    from towerrec.distributed.launch import free_port

    config = _config()
    for rank, faster in ((0, "fbgemm"), (1, "torch")):  # a cache per rank, disagreeing
        _fake_backends(monkeypatch, **{"torch": 2.0, "fbgemm": 2.0, faster: 1.0})
        batch = dataclasses.replace(config.train, batch_size=config.train.batch_size // 2)
        half = dataclasses.replace(config, train=batch)  # the batch per rank of 2 ranks
        resolve_choices(half, _schema(config), CPU, cache=ChoiceCache(tmp_path / str(rank)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_choose_on_rank, args=(r, 2, port, tmp_path, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict((r, (a, f)) for r, a, f in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][0] == results[1][0] == [("fbgemm", "cached")] * 2
    assert results[0][1] == results[1][1] == 0


def test_bench_choice_compares_the_auto_kernel_with_the_forced_ones(one_thread):
    from towerrec.bench.choice import choice_benchmark

    tiny = {
        "num_dense": 3,
        "num_tables": 2,
        "num_embeddings": [50, 70],
        "pooling_factors": [1, 2],
        "embedding_dim": 8,
        "bottom_mlp": [8, 8],
        "top_mlp": [8, 1],
    }
    result = choice_benchmark({"tiny": tiny}, batch_size=8, steps=2)
    row = result["tiny"]
    assert row["auto"] in row["forced_ms"] and row["best_forced"] in row["forced_ms"]
    assert set(row["auto_ms"]) == set(row["forced_ms"]) and row["auto_over_best"] >= 1.0


def test_bench_choice_times_the_steps_at_the_precision_asked(monkeypatch, one_thread):
    from towerrec.bench import choice as bench_choice

    dtypes = []

    def timer(workload, backends, **kwargs):
        dtypes.append(kwargs.get("dtype"))
        return {b: 1.0 + i for i, b in enumerate(backends)}

    monkeypatch.setattr(bench_choice, "time_backend_steps", timer)
    tiny = dict(bench_choice.SHAPES["planted"])
    bench_choice.choice_benchmark({"planted": tiny}, batch_size=8, steps=2, precision="bf16")
    assert dtypes and all(d is torch.bfloat16 for d in dtypes)  # the quick and the forced timing


class ClockedTimer(FakeTimer):
    """A measurement whose timed rounds ran ``cpu_s`` CPU seconds in ``wall_s`` wall
    seconds (injected, as a starved or a quiet process would see them)."""

    def __init__(self, seconds, wall_s, cpu_s, steps=None):
        super().__init__(seconds)
        self.wall_s, self.cpu_s, self.steps = wall_s, cpu_s, steps or {}

    def _record(self, stats):
        stats.wall_s, stats.cpu_s = self.wall_s, self.cpu_s
        for name, times in self.steps.items():
            for t in times:
                stats.add_step(name, t)

    def backends(self, workload, backends, stats=None, **_):
        self._record(stats)
        return super().backends(workload, backends)

    def precisions(self, *args, stats=None, **kwargs):
        self._record(stats)
        return super().precisions()


@pytest.mark.parametrize(
    ("wall_s", "cpu_s", "steps", "noisy"),
    [
        (1.0, 0.95, {"a": [1.0, 1.1, 1.05]}, None),
        (2.0, 0.5, {}, "0.50 CPU s in 2.00 wall s"),  # starved: a quarter of a core
        (1.0, 1.0, {"a": [1.0, 1.1], "b": [1.0, 2.5, 2.5]}, "b's timed steps spread 2.50x"),
        (0.0, 0.0, {}, None),  # nothing timed: nothing to judge
    ],
)
def test_a_timing_is_noisy_when_starved_or_its_steps_disagree(wall_s, cpu_s, steps, noisy):
    stats = TimingStats(wall_s, cpu_s, steps)
    assert (stats.noise() is None) if noisy is None else (noisy in stats.noise())


def test_a_noisy_precision_timing_is_used_but_not_cached(monkeypatch, measuring, caplog):
    monkeypatch.setattr(choices, "bf16_units", lambda device: "avx512_bf16")
    starved = ClockedTimer({"fp32": 2.0, "bf16": 1.0}, wall_s=1.0, cpu_s=0.3)
    monkeypatch.setattr(choices, "time_precisions", starved.precisions)
    config = _config("train.precision=auto", "embedding.backend=torch")
    with caplog.at_level("INFO", logger="towerrec"):
        resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.train.precision == "bf16" and made["precision"].how == "measured"
    assert "not cached" in made["precision"].why
    assert "the next run measures again" in caplog.text
    assert not measuring.exists()
    _, made = resolve_choices(config, _schema(config), CPU)
    assert made["precision"].how == "measured" and starved.calls == 2  # measured anew
    quiet = ClockedTimer({"fp32": 0.9, "bf16": 1.0}, wall_s=1.0, cpu_s=1.0)
    monkeypatch.setattr(choices, "time_precisions", quiet.precisions)
    resolve_choices(config, _schema(config), CPU)
    entry = next(iter(json.loads(measuring.read_text())["entries"].values()))
    assert entry["choice"] == "fp32"  # a quiet timing is kept
    _, made = resolve_choices(config, _schema(config), CPU)
    assert made["precision"].how == "cached" and quiet.calls == 1


@needs_fbgemm
def test_a_kernel_timing_whose_steps_disagree_is_not_cached(monkeypatch, measuring):
    # a loaded machine: torch looked faster, but its own steps varied 3x
    steps = {"torch": [0.312, 0.9, 0.95], "fbgemm": [0.548, 0.55, 0.56]}
    timer = ClockedTimer({"torch": 0.312, "fbgemm": 0.548}, 1.0, 1.0, steps)
    monkeypatch.setattr(choices, "time_backend_steps", timer.backends)
    config = _config()
    resolved, made = resolve_choices(config, _schema(config), CPU)
    assert resolved.embedding.backend is Backend.TORCH  # this run uses what it measured
    assert "torch's timed steps spread" in made["backend"].why
    assert not measuring.exists() or "backend" not in measuring.read_text()


@needs_fbgemm
def test_the_kernels_are_timed_at_the_runs_precision(monkeypatch, measuring):
    """The precision is resolved first; the kernel timing runs under its autocast, and a
    choice made at one precision is not reused for another."""
    dtypes = []

    def backends(workload, candidates, **kwargs):
        dtypes.append(kwargs.get("dtype"))
        return {b: {"torch": 1.0, "fbgemm": 2.0}[b.value] for b in candidates}

    monkeypatch.setattr(choices, "time_backend_steps", backends)
    for precision in ("bf16", "fp32", "bf16"):
        config = _config(f"train.precision={precision}")
        resolve_choices(config, _schema(config), CPU)
    assert dtypes == [torch.bfloat16, None]  # the second bf16 run read the cache
