"""``towerrec bench fuzz``: every parser and every file towerrec reads back, fuzzed with
Hypothesis (``bench/fuzz_core.py`` says what a target holds its reader to).

::

    towerrec bench fuzz --json --examples 10000       each target, 10,000 inputs
    towerrec bench fuzz --targets criteo_lines,plan_json --examples 500 --seed 3

Per target: the inputs tried (Hypothesis's count, shrinking included), seconds,
and the failure with its minimal input if one was found. Targets whose reader is
slow (a resume, a prediction, a conversion per input) run ``--examples`` times
their ``SCALE`` (every target gets at least ``MIN_EXAMPLES``). The CI budget is
tests/test_fuzz.py: each target derandomized, a few seconds.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from towerrec.bench.common import Benchmark, comma_list, machine_info
from towerrec.bench.fuzz_config import CONFIG_TARGETS
from towerrec.bench.fuzz_core import FuzzTarget, release_fixtures, run_target
from towerrec.bench.fuzz_inputs import INPUT_TARGETS
from towerrec.bench.fuzz_json import JSON_TARGETS
from towerrec.bench.fuzz_state import STATE_TARGETS
from towerrec.bench.fuzz_text import TEXT_TARGETS

__all__ = ["BENCHMARK", "MIN_EXAMPLES", "SCALE", "TARGETS", "run_fuzz"]

TARGETS: dict[str, FuzzTarget] = {
    t.name: t
    for t in (*TEXT_TARGETS, *CONFIG_TARGETS, *JSON_TARGETS, *STATE_TARGETS, *INPUT_TARGETS)
}
# share of --examples for the targets whose every input runs a slow reader
SCALE = {
    "checkpoint_meta": 0.05,
    "predict_tsv": 0.05,
    "augmented_manifest": 0.2,
    "libfm_lines": 0.2,
    "table_schema": 0.2,
    "cache_manifest": 0.2,
}
MIN_EXAMPLES = 50


def run_fuzz(
    targets: tuple[str, ...] = tuple(TARGETS), examples: int = 1000, seed: int | None = None
) -> dict[str, Any]:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"--targets: unknown {unknown}; choose from {', '.join(TARGETS)}")
    if examples < 1:
        raise ValueError(f"--examples must be >= 1, got {examples}")
    try:
        import hypothesis
    except ImportError:
        raise ImportError(
            "towerrec bench fuzz needs Hypothesis: pip install 'towerrec[dev]'"
        ) from None
    start = time.perf_counter()
    results = {}
    try:
        for name in targets:
            n = max(MIN_EXAMPLES, round(examples * SCALE.get(name, 1.0)))
            results[name] = run_target(TARGETS[name], n, seed=seed, raise_failure=False)
    finally:
        release_fixtures()  # the runs and caches the targets trained once
    tried = sum(r["examples"] for r in results.values())
    return {
        "machine": machine_info(),
        "hypothesis": hypothesis.__version__,
        "examples_per_target": examples,
        "seed": seed,
        "targets": results,
        "total_examples": tried,
        "failures": sorted(n for n, r in results.items() if "failure" in r),
        "seconds": round(time.perf_counter() - start, 1),
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--targets", type=comma_list, default=tuple(TARGETS), help=f"of {','.join(TARGETS)}"
    )
    parser.add_argument(
        "--examples", type=int, default=1000, help="inputs per target (times its SCALE)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="a random run of this seed (default: derandomized)"
    )


def _run(args: argparse.Namespace) -> dict:
    return run_fuzz(args.targets, args.examples, args.seed)


BENCHMARK = Benchmark(
    "Hypothesis fuzzing of every parser and file towerrec reads back: inputs tried, failures",
    _add_arguments,
    _run,
)
