"""The tests' command runner (``cli_server.py``) against a real ``python -m towerrec.cli``:
the same status, output and error, from the same directory and environment."""

import os
import subprocess
import sys

import cli_server
import pytest
from conftest import ROOT

CASES = [
    ["config", "show", "--set", "train.steps=7"],  # status 0, output
    ["config", "show", "--set", "nonsense.key=1"],  # a user error: status 2, one line
    ["nonsense"],  # argparse's error: status 2, usage
    ["config", "show", "--config", "relative.toml"],  # a path relative to the directory
]


@pytest.mark.parametrize("args", CASES, ids=["ok", "user-error", "usage", "relative"])
def test_a_forked_command_ends_as_a_fresh_process_does(tmp_path, args):
    (tmp_path / "relative.toml").write_text("[train]\nsteps = 3\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOWERREC_SOMETHING": "1"}
    fresh = subprocess.run(
        [sys.executable, "-m", "towerrec.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    forked = cli_server.run(args, tmp_path, env)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    # Warnings and errors carry the time of day; the rest of each line is the same.
    assert [line[9:] for line in forked.stderr.splitlines()] == [
        line[9:] for line in fresh.stderr.splitlines()
    ]
    assert forked.args == [sys.executable, "-m", "towerrec.cli", *args]


def test_variables_read_at_load_time_get_a_server_of_their_own(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    other, omp = {**env, "TOWERREC_OTHER": "x"}, {**env, "OMP_NUM_THREADS": "1"}
    for each in (env, other, omp):
        assert cli_server.run(["config", "show"], tmp_path, each).returncode == 0
    assert cli_server._load_time(other) == cli_server._load_time(env)
    assert cli_server._load_time(omp) != cli_server._load_time(env)
    for each, threads in ((env, os.environ.get("OMP_NUM_THREADS")), (omp, "1")):
        server = cli_server._SERVERS[cli_server._load_time(each)]
        with open(f"/proc/{server.proc.pid}/environ", "rb") as f:
            found = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        assert found.get(b"OMP_NUM_THREADS") == (threads.encode() if threads else None)


def test_a_command_past_its_time_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with pytest.raises(subprocess.TimeoutExpired):
        cli_server.run(["train", "--set", "train.steps=100000"], tmp_path, env, timeout=2)
    assert cli_server.run(["config", "show"], tmp_path, env).returncode == 0  # still serving


def test_a_server_that_ended_is_started_again(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    assert cli_server.run(["config", "show"], tmp_path, env).returncode == 0
    ended = cli_server._SERVERS[cli_server._load_time(env)].proc
    ended.kill()
    ended.wait()
    assert cli_server.run(["config", "show"], tmp_path, env).returncode == 0
    assert cli_server._SERVERS[cli_server._load_time(env)].proc is not ended
