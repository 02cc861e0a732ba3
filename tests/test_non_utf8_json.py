"""JSON files towerrec writes, with one byte set to 0xFF (no longer UTF-8): each reader
refuses the file with an error that names it, and the choice cache ignores its file
with a warning and writes it again."""

import json

import pytest
from test_costdata import _data

from towerrec.build.choice_cache import ChoiceCache
from towerrec.cli import main
from towerrec.data.profile import LocalityProfile
from towerrec.planner.cost import CostConstants
from towerrec.planner.costdata import CostData
from towerrec.planner.stats import TableStats, load_stats, save_stats
from towerrec.workflows.sweep import read_runs


def _runs(path):  # as the sweep appends its records
    with path.open("a") as f:
        for point in range(3):
            f.write(json.dumps({"point": point, "status": "ok", "ne": 0.9 - point / 10}) + "\n")


READERS = {
    "calibration": (lambda p: CostConstants().save(p), CostConstants.load),
    "cost data": (lambda p: _data().save(p), CostData.load),
    "statistics": (lambda p: save_stats([TableStats("t", 100, 8)], p), load_stats),
    "locality profile": (
        lambda p: LocalityProfile("synthetic", 64, 128, 128, 100, ()).save(p),
        LocalityProfile.load,
    ),
    "sweep runs": (_runs, read_runs),
}


def _not_utf8(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] = 0xFF
    path.write_bytes(raw)


@pytest.mark.parametrize("kind", sorted(READERS))
def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path, kind):
    write, read = READERS[kind]
    path = tmp_path / "file.json"
    write(path)
    read(path)  # the undamaged file reads
    _not_utf8(path)
    with pytest.raises(ValueError) as error:
        read(path)
    assert str(path) in str(error.value)


def test_the_plan_command_names_a_calibration_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    CostConstants().save(path)
    _not_utf8(path)
    assert main(["plan", "--world-size", "2", "--set", f"plan.calibration={path}"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: calibration file {str(path)!r} is not valid JSON")


def test_a_statistics_entry_error_names_the_file(tmp_path):
    path = tmp_path / "stats.json"
    save_stats([TableStats("t", 100, 8)], path)
    path.write_text(path.read_text().replace('"hot1_share"', '"hot1_shar"'))
    with pytest.raises(ValueError, match=r"stats.json', entry 0: unknown fields \['hot1_shar'\]"):
        load_stats(path)


def test_a_choice_file_that_is_not_utf8_is_ignored_and_rewritten(tmp_path, caplog):
    cache = ChoiceCache(tmp_path)
    machine, workload = {"cpu": "test"}, {"tables": 2}
    cache.store("backend", machine, workload, "torch", {"torch": 1.0, "fbgemm": 2.0})
    _not_utf8(cache.path)
    with caplog.at_level("WARNING", logger="towerrec"):
        assert cache.lookup("backend", machine, workload, ("torch", "fbgemm")) is None
    assert f"{cache.path} is damaged" in caplog.text
    cache.store("backend", machine, workload, "fbgemm", {"torch": 2.0, "fbgemm": 1.0})
    entry = cache.lookup("backend", machine, workload, ("torch", "fbgemm"))
    assert entry is not None and entry["choice"] == "fbgemm"
