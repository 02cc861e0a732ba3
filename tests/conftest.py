import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from towerrec.train.numerics import flushing_subnormals, set_flush_subnormals

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None and HAS_FBGEMM

needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed")
needs_torchrec = pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed")

# Set by pytest for each test, by torch the first time it needs its compile cache, and by
# scikit-learn's import (OpenMP settings of its own).
_OWN_VARIABLES = (
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
)


def _process_state() -> dict:
    """The process-wide settings a run's numbers or a launched worker could inherit."""
    return {
        "threads": torch.get_num_threads(),
        "fp32 matmul precision": torch.backends.mkldnn.matmul.fp32_precision,
        "subnormals flushed": flushing_subnormals(),
        "environment": {k: v for k, v in os.environ.items() if k not in _OWN_VARIABLES},
    }


_BASELINE: dict = {}  # the process's own, before any test ran (``pytest_configure``)
TEARDOWN_LOG = Path()
_SESSION_DIRS: list[Path] = []
_NAMES = ("cache", "teardown")


def pytest_configure(config):
    """The session's settings, made by the pytest process alone (a rank that imports a
    test module imports this file too, and inherits them instead of making its own);
    its directories are removed when the session ends."""
    global TEARDOWN_LOG
    # `auto` settings resolve by their fixed rules, not by timing (a test's numbers must
    # not depend on how busy the machine is), and measured choices never reach the
    # user's cache; the tests of the measurement (test_choices.py) turn it on with
    # monkeypatch. Set before the baseline, so that every test and every process it
    # starts inherits both.
    cache, teardown = (Path(tempfile.mkdtemp(prefix=f"towerrec-test-{n}-")) for n in _NAMES)
    _SESSION_DIRS[:] = [cache, teardown]
    os.environ["TOWERREC_MEASURE"] = "0"
    os.environ["TOWERREC_CACHE_DIR"] = str(cache)
    # Every world of `spawn_world` whose rank crashed in teardown after returning its
    # value, in this process or in one a test started, is appended here
    # (distributed/launch.py); `_no_teardown_crash` fails the test that made it.
    TEARDOWN_LOG = teardown / "crashes.jsonl"
    TEARDOWN_LOG.touch()
    os.environ["TOWERREC_TEARDOWN_LOG"] = str(TEARDOWN_LOG)
    _BASELINE.update(_process_state())


def pytest_unconfigure(config):
    for directory in _SESSION_DIRS:
        shutil.rmtree(directory, ignore_errors=True)


def _restore(state: dict) -> None:
    torch.set_num_threads(state["threads"])
    if torch.backends.mkldnn.matmul.fp32_precision != state["fp32 matmul precision"]:
        torch.backends.mkldnn.matmul.fp32_precision = state["fp32 matmul precision"]
    if flushing_subnormals() != state["subnormals flushed"]:
        set_flush_subnormals(state["subnormals flushed"])
    for name in set(os.environ) - set(state["environment"]) - set(_OWN_VARIABLES):
        del os.environ[name]
    os.environ.update(state["environment"])


@pytest.fixture(autouse=True)
def _no_leaked_process_state():
    """Every test starts from the process's own settings (a module-scoped fixture cannot
    hand its tests another thread count), and a test that leaves one changed fails, so
    that no test depends on which tests ran before it. Change them through a fixture
    that restores them (``one_thread``, ``monkeypatch.setenv``)."""
    _restore(_BASELINE)
    yield
    left = _process_state()
    if left != _BASELINE:
        changed = sorted(k for k in left if left[k] != _BASELINE[k])
        env = left["environment"], _BASELINE["environment"]
        names = sorted(k for k in env[0].keys() | env[1].keys() if env[0].get(k) != env[1].get(k))
        _restore(_BASELINE)
        pytest.fail(f"the test left process-wide settings changed: {changed} {names or ''}")


@pytest.fixture(autouse=True)
def _no_teardown_crash():
    """A test fails when one of its worlds had a rank that returned its value and then
    crashed or hung tearing down: the harness counts the values, but such a crash is a
    bug to find, not a pass. A test that provokes one on purpose points
    ``TOWERREC_TEARDOWN_LOG`` elsewhere with ``monkeypatch.setenv``."""
    start = TEARDOWN_LOG.stat().st_size
    yield
    with TEARDOWN_LOG.open() as f:
        f.seek(start)
        crashes = [json.loads(line) for line in f if line.strip()]
    if crashes:
        pytest.fail(f"a rank crashed in teardown after returning its value: {crashes}")


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (fast and stable next to other processes)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(_BASELINE["threads"])


ROOT = Path(__file__).parent.parent


def run_cli(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """``towerrec ARGS...`` in a subprocess on this checkout's code, from ``cwd`` (the
    repo root unless given: relative paths resolve as a user in that folder types them).

    Other keyword arguments add environment variables (e.g. ``OMP_NUM_THREADS="1"``).
    The process is forked from a server that has imported torch (``cli_server.py``).
    """
    import cli_server  # beside this file (a copy of it elsewhere needs no server)

    return cli_server.run(list(args), cwd, {**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})


def pytest_terminal_summary(terminalreporter, config):
    """The shuffled order's seed, in quiet runs too: `pytest -p random_order
    --random-order-seed=N` runs the same order again."""
    seed = getattr(config.option, "random_order_seed", None)
    if seed is not None:
        seed = str(seed).removeprefix("default:")
        terminalreporter.write_line(f"test order: --random-order-seed={seed}")
