import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None and HAS_FBGEMM

needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed")
needs_torchrec = pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed")


@pytest.fixture(autouse=True)
def _single_thread_determinism():
    # Tests compare results bit-for-bit or to tight tolerances; keep them fast and stable.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


ROOT = Path(__file__).parent.parent


def run_cli(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """``towerrec ARGS...`` in a subprocess on this checkout's code, from ``cwd`` (the
    repo root unless given: relative paths resolve as a user in that folder types them).

    Other keyword arguments add environment variables (e.g. ``OMP_NUM_THREADS="1"``).
    """
    return subprocess.run(
        [sys.executable, "-m", "towerrec.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
    )
