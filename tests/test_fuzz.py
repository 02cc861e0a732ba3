"""Every fuzz target of ``towerrec bench fuzz`` at a fixed budget (derandomized: the
same inputs on every run), and the inputs the fuzzers found that once broke a reader,
kept as regression examples: each must now be read as the format says or refused
with an error naming the file, line or key."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

from towerrec.bench import fuzz_core
from towerrec.bench.fuzz import TARGETS, run_fuzz
from towerrec.bench.fuzz_core import FuzzFailure, FuzzTarget, refused, run_target

# Inputs per target: a few seconds each on one loaded core.
BUDGET = {
    "criteo_lines": 40,
    "libfm_field_map": 100,
    "libfm_lines": 30,
    "config_toml": 100,
    "config_set": 100,
    "plan_json": 60,
    "cache_manifest": 40,
    "checkpoint_meta": 15,
    "store_header": 50,
    "kv_store_header": 40,
    "kv_checkpoint_meta": 40,
    "table_schema": 60,
    "predict_tsv": 15,
    "augmented_manifest": 30,
}
# Targets that first train a model (and export it, or run the augmentation service).
SLOW = {"checkpoint_meta", "predict_tsv", "augmented_manifest"}


def test_every_target_has_a_budget():
    assert set(BUDGET) == set(TARGETS)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(BUDGET)],
)
def test_the_reader_holds_on_a_fixed_budget(name, one_thread):
    result = run_target(TARGETS[name], BUDGET[name])
    assert result["examples"] >= BUDGET[name] // 2  # Hypothesis ran the inputs asked for


def _crashes(example, scratch):
    raise KeyError("manifest")


def _names_nothing(example, scratch):
    refused(lambda: int("x"), str(scratch))


@pytest.mark.parametrize("check", [_crashes, _names_nothing])
def test_a_target_fails_on_an_unhandled_error_or_an_error_that_names_nothing(check):
    from hypothesis import strategies as st

    target = FuzzTarget("broken", "nothing", lambda: st.just(1), check)
    with pytest.raises(FuzzFailure):
        run_target(target, 3)
    result = run_target(target, 3, raise_failure=False)
    assert "FuzzFailure" in result["failure"] and result["example"] == "1"


def _spins(example, scratch):
    while True:
        pass


def _sleeps(example, scratch):
    time.sleep(1.0)


def test_a_hang_is_an_example_that_uses_cpu_time_not_one_that_waits(monkeypatch):
    """A busy machine slows an example's clock, not its CPU time: an example that waits
    1 s is no hang at a 0.3 s limit, one that spins is (a deadlock: ``HANG_WALL_S``)."""
    from hypothesis import strategies as st

    monkeypatch.setattr(fuzz_core, "HANG_S", 0.3)
    waits = run_target(FuzzTarget("waits", "nothing", lambda: st.just(1), _sleeps), 1)
    assert waits["examples"] == 1 and "failure" not in waits
    spins = FuzzTarget("spins", "nothing", lambda: st.just(1), _spins)
    with pytest.raises(FuzzFailure, match=r"used 0.3 s of CPU: a hang"):
        run_target(spins, 1)
    monkeypatch.setattr(fuzz_core, "HANG_WALL_S", 0.3)
    with pytest.raises(FuzzFailure, match=r"waited 0.3 s: a hang"):
        run_target(FuzzTarget("waits", "nothing", lambda: st.just(1), _sleeps), 1)


def test_the_benchmark_counts_the_inputs_of_each_target():
    result = run_fuzz(("config_set", "plan_json"), examples=50)
    assert result["failures"] == []
    tried = {name: r["examples"] for name, r in result["targets"].items()}
    assert tried["config_set"] >= 50 and result["total_examples"] == sum(tried.values())
    with pytest.raises(ValueError, match="unknown"):
        run_fuzz(("no_such_target",))


TAB = b"\t"
ROW = b"1" + TAB * 39  # a Criteo line of a label and 39 empty fields


def _criteo(*lines, newline=True):
    return (list(lines), newline, 1 << 20)


def _meta(stopped=False, **changes):
    meta = {
        "threads": 1,
        "train_bytes": [0.0, 0.0, 0.0, 0.0],
        "early_stopping": {
            "best_step": 2, "best_value": 0.6, "best_metrics": {"auc": 0.5},
            "since_best": 0, "lr_scale": 1.0, "stopped": stopped,
        },
    }  # fmt: skip
    meta.update(changes)
    return json.dumps(meta).encode()


# (target, input) pairs that broke a reader before it was fixed
FOUND = [
    ("criteo_lines", _criteo(b"01" + TAB * 39)),  # label '01' read as 1 on one path only
    ("criteo_lines", _criteo(b"1\t1234567890123456789" + TAB * 38, b"x" + TAB * 39)),
    ("criteo_lines", _criteo(b"1\t+5" + TAB * 38)),  # crashed the text path
    ("criteo_lines", _criteo(ROW, b"0" + TAB * 13 + b"\r" + TAB * 26)),  # a lone CR
    ("criteo_lines", _criteo(ROW, b"0\r")),  # CRLF on a malformed line
    ("criteo_lines", _criteo(b"1\t\xff" + TAB * 38)),  # not UTF-8
    ("libfm_lines", ["0\x1c", "1 0:1"]),  # a form feed split the line numbers
    ("libfm_lines", ["nan 0:1", "1 6:inf", "1 0:1"]),  # non-finite label and value
    ("config_toml", b"\x80"),  # not UTF-8: the error named no file
    ("config_set", ".="),
    ("config_set", "data.loader.verify=false"),  # a documented second spelling of "never"
    ("config_set", "data.loader.verify=true"),
    ("config_set", "train.temporal.fgd_generator=false"),
    ("config_toml", b"[data.loader]\nverify = false\n"),
    ("config_set", "train.steps=5\nother = 2"),  # read as 5, the rest dropped
    ("plan_json", b"null"),
    (
        "plan_json",
        b'{"world_size": 2, "tables": {"t0": {"sharding": "table_wise", '
        b'"shards": [{"rank": 0, "rows": ["0", 40], "cols": [0, 8]}]}}}',
    ),
    ("cache_manifest", b"null"),
    ("checkpoint_meta", _meta(early_stopping={"since_best": 0, "lr_scale": 1.0, "stopped": 0})),
    ("checkpoint_meta", _meta(train_bytes=None)),
    ("checkpoint_meta", _meta(threads="2")),
    ("checkpoint_meta", _meta(stopped=True)),  # refused naming the run, not meta.json
    ("store_header", ("cut", b"TWRSTORE\x01\x00\x00\x00W\x00\x00\x00{")),
    (
        "kv_store_header",
        b'{"format": "towerrec-kv", "version": 1, "table": "t0", "rows": 16, '
        b'"dim": 4, "dtype": "float32", "states": [[1]], "init": "uniform", "seed": 0}',
    ),
    ("kv_checkpoint_meta", b'{"bytes": 16384, "crc32": 1, "header": null, "rows": 0}'),
    (
        "table_schema",
        (
            "csv",
            {"y": ["0"], "a": [None], "b": [None], "c": [None]},
            {"label": "y", "dense": [], "categorical": {}, "multi_hot": {"y": 2}},
        ),
    ),
    (
        "table_schema",
        (
            "csv",
            {"y": ["1"], "a": ["x"], "b": [None], "c": [None]},
            {"label": "y", "dense": [], "categorical": {}, "multi_hot": {"a": 2}},
        ),
    ),
    (
        "table_schema",
        (
            "csv",
            {"y": ["1", "0"], "a": ["nan", "1"], "b": ["x", "y"], "c": ["", ""]},
            {"label": "y", "dense": ["a"], "categorical": {"b": 5}, "multi_hot": {}},
        ),
    ),
    ("predict_tsv", [b"", b"0" + TAB * 39]),  # a skipped line shifted the predictions
    ("augmented_manifest", b'{"format": "towerrec-cache", "version": 1, "source": "augmented"}'),
]


@pytest.mark.parametrize(
    ("name", "example"),
    [pytest.param(n, e, marks=pytest.mark.slow) if n in SLOW else (n, e) for n, e in FOUND],
)
def test_an_input_a_fuzzer_found_is_read_or_refused_clearly(name, example, tmp_path, one_thread):
    TARGETS[name].check(example, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["rows", "multi_values"])
def test_an_augmented_part_without_training_rows_is_refused_clearly(key, tmp_path, one_thread):
    """Found by `towerrec bench fuzz`: a part whose manifest entry lists no `train` rows
    (or no `train` value counts of its multi-hot feature) failed with KeyError 'train'."""
    from towerrec.bench.fuzz_inputs import _augmented

    manifest = json.loads((_augmented() / "manifest.json").read_text())
    manifest["parts"][0][key] = {}
    TARGETS["augmented_manifest"].check(json.dumps(manifest).encode(), tmp_path)


@pytest.mark.slow
def test_an_augmented_manifest_whose_period_rows_disagree_with_its_periods_is_refused(
    tmp_path, one_thread
):
    """Found by `towerrec bench fuzz`: a manifest whose stream listed fewer period_rows
    than its num_periods was accepted and trained on the periods listed (40 rows, not 80)."""
    from towerrec.bench.fuzz_inputs import _augmented

    manifest = json.loads((_augmented() / "manifest.json").read_text())
    manifest["stream"]["period_rows"] = manifest["stream"]["period_rows"][:1]
    TARGETS["augmented_manifest"].check(json.dumps(manifest).encode(), tmp_path)


def test_the_config_oracle_reads_a_documented_second_spelling_and_nothing_else(
    monkeypatch, tmp_path
):
    """``--set data.loader.verify=false`` is ``"never"`` (config.VALUE_ALIASES): the oracle
    takes the spelling as what the config says it stands for, and flags any other reading."""
    from towerrec.config import VALUE_ALIASES

    check = TARGETS["config_set"].check
    check("data.loader.verify=false", tmp_path)
    monkeypatch.setitem(VALUE_ALIASES, "data.loader.verify", {False: "always"})
    with pytest.raises(FuzzFailure, match="was read as"):
        check("data.loader.verify=false", tmp_path)
    monkeypatch.delitem(VALUE_ALIASES, "data.loader.verify")
    with pytest.raises(FuzzFailure, match="was read as"):
        check("data.loader.verify=false", tmp_path)


def test_every_documented_second_spelling_is_read_as_the_value_it_stands_for():
    from towerrec.config import VALUE_ALIASES, config_to_dict, load_config

    for key, aliases in VALUE_ALIASES.items():
        for written, meant in aliases.items():
            node = config_to_dict(load_config(None, [f"{key}={json.dumps(written)}"]))
            for part in key.split("."):
                node = node[part]
            assert node == meant, key


@pytest.mark.slow
@pytest.mark.parametrize(
    "error", [KeyError("threads"), ValueError("meta.json is damaged"), TypeError("None")]
)
def test_the_meta_oracle_flags_a_crash_or_an_error_naming_neither_file_nor_run(
    error, monkeypatch, tmp_path, one_thread
):
    from towerrec.bench.fuzz_state import _tiny_run
    from towerrec.train import session

    _tiny_run()  # trained before set_up is replaced

    def set_up(*args, **kwargs):
        raise error

    monkeypatch.setattr(session, "set_up", set_up)
    with pytest.raises(FuzzFailure):
        TARGETS["checkpoint_meta"].check(_meta(), tmp_path)


def test_a_json_mutation_leaves_the_file_it_mutates_as_it_was():
    """Found by `towerrec bench fuzz` (kv_store_header): Hypothesis stopped on
    FlakyStrategyDefinition. A value near the original (``[value]``) shared the header's
    lists; a second mutation of the same input changed them in place, so the next inputs
    were drawn from another header and a replay drew differently."""
    from towerrec.bench.fuzz_json import _mutated, _near

    base = {"format": "towerrec-kv", "states": [["momentum1", 1]]}
    wrapped = _near(base["states"])[2]  # [value]: the states list itself, not a copy
    assert wrapped == [base["states"]]
    mutations = [("set", ("states",), wrapped), ("set", ("states", 0, 0), None)]
    first = _mutated(base, mutations)
    assert base == {"format": "towerrec-kv", "states": [["momentum1", 1]]}
    assert _mutated(base, mutations) == first
    assert json.loads(first)["states"] == [[None]]
    assert mutations[0][2] == [[["momentum1", 1]]]


def test_the_files_the_targets_make_once_are_removed(tmp_path):
    """The runs and caches the targets train once live under one temporary folder,
    removed by release_fixtures (run_fuzz's end) or when the process exits."""
    folder = fuzz_core.made_once("test-fixture", lambda d: d)
    assert folder.is_dir() and fuzz_core.made_once("test-fixture", lambda d: None) == folder
    fuzz_core.release_fixtures()
    assert not folder.parent.exists()
    code = (
        "from towerrec.bench.fuzz_core import made_once\n"
        "folder = made_once('x', lambda d: d)\n"
        "(folder / 'file').write_text('1')\n"
        "print(folder.parent)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
    )
    root = Path(done.stdout.strip())
    assert root.name.startswith("towerrec-fuzz-fixtures-") and not root.exists()
