"""The command line starts at once: building its parser and printing help imports no
torch, no numpy and no benchmark module; each command imports the library when it runs."""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from towerrec.cli import choices
from towerrec.cli.bench import BENCHMARKS

# Runs `main(ARGV + ["--help"])` for each ARGV in sys.argv[1] (JSON), then prints the
# towerrec.bench modules, torch and numpy (and their submodules) it imported, as JSON.
_HELP_IMPORTS = """
import contextlib, io, json, sys
from towerrec.cli.app import main

for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit:
            pass
print(json.dumps(sorted(
    m for m in sys.modules if m.split(".")[0] in ("torch", "numpy") or
    m == "towerrec.bench" or m.startswith("towerrec.bench.")
)))
"""


def _imported(code: str, *args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _help_imports(*argvs: list[str]) -> list[str]:
    return _imported(_HELP_IMPORTS, json.dumps(argvs))


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser`` by name (none: empty)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_the_help_of_every_command_imports_no_torch_numpy_or_benchmark():
    from towerrec.cli.app import build_parser

    argvs = [[]]
    for name, group in _commands(build_parser()).items():
        argvs.append([name])
        if name != "bench":  # `towerrec bench NAME --help` imports NAME's module
            argvs.extend([name, command] for command in _commands(group))
    assert ["train"] in argvs and ["bench"] in argvs and ["data", "criteo"] in argvs
    assert _help_imports(*argvs) == []


def test_a_benchmark_s_help_imports_its_module_alone():
    """``towerrec bench NAME --help`` shows the arguments NAME's module declares, and
    imports what importing that module imports, nothing more."""
    shown = subprocess.run(
        [sys.executable, "-m", "towerrec.cli", "bench", "dmt-scale", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert shown.returncode == 0, shown.stderr
    assert "--json" in shown.stdout and "--cross-host-gbs" in shown.stdout
    alone = _imported(
        "import json, sys, towerrec.bench.dmt_scale; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', "
        "'numpy') or m == 'towerrec.bench' or m.startswith('towerrec.bench.'))))"
    )
    assert "towerrec.bench.dmt_scale" in alone
    assert _help_imports(["bench", "dmt-scale"]) == alone


def test_the_benchmark_table_shows_each_module_s_help_line():
    for name, entry in BENCHMARKS.items():
        assert entry.load().help == entry.help, name


def test_the_values_the_help_shows_are_the_library_s():
    from towerrec.config.nas import SearchSpaceKind
    from towerrec.data.profile import DEFAULT_MAX_IDS, PROFILE_NAME
    from towerrec.serve.export import TableDtype
    from towerrec.serve.predict import SPLITS
    from towerrec.workflows.pu.prior import FOLDS, TOP_FRACTION

    assert tuple(d.value for d in TableDtype) == choices.EXPORT_TABLE_DTYPES
    assert TableDtype.FP32.value == choices.EXPORT_TABLE_DTYPES[0]  # export's default
    assert SPLITS == choices.PREDICT_SPLITS
    assert tuple(s.value for s in SearchSpaceKind) == choices.NAS_SPACES
    assert (DEFAULT_MAX_IDS, PROFILE_NAME) == (choices.PROFILE_MAX_IDS, choices.PROFILE_NAME)
    assert (FOLDS, TOP_FRACTION) == (choices.PU_FOLDS, choices.PU_TOP_FRACTION)


def test_every_benchmark_declares_arguments_that_parse_beside_the_shared_ones():
    """Each benchmark's own arguments join the ones `towerrec bench` gives every entry
    (``--json``) without a clash: a clash makes the benchmark unusable from the CLI."""
    from towerrec.cli.app import build_parser

    parser = build_parser()
    for name in BENCHMARKS:
        with pytest.raises(SystemExit) as ended, contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(["bench", name, "--json", "--help"])
        assert ended.value.code == 0, name
