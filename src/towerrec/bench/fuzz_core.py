"""What every fuzz target of ``towerrec bench fuzz`` (and tests/test_fuzz.py) shares.

A target (``FuzzTarget``) is a Hypothesis strategy of inputs and a check that
feeds one input to one of towerrec's readers. The property every check holds
its reader to: the input is read (and, where a reference reader exists, read
to the same values: no silent wrong value), or refused with a clear error (a
``ValueError``, or the reader's own subclass of it, whose message names the
file, line or key: ``refused``), or its bad lines are skipped and counted. Any
other exception, an error that names nothing, or an example using ``HANG_S``
seconds of CPU (or waiting ``HANG_WALL_S``) fails the target; Hypothesis then shrinks the input to a minimal one.

Hypothesis is a development dependency (``pip install 'towerrec[dev]'``); it is
imported when a target is run.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "HANG_S",
    "HANG_WALL_S",
    "FuzzFailure",
    "FuzzTarget",
    "made_once",
    "refused",
    "release_fixtures",
    "run_target",
]

HANG_S = 20.0  # one example using this many seconds of CPU is a hang
HANG_WALL_S = 600.0  # ... or waiting this long in all (a deadlock)
T = TypeVar("T")


class FuzzFailure(AssertionError):
    """A reader broke the property on one input; the message says how."""


@dataclass(frozen=True)
class FuzzTarget:
    """``check(example, scratch)`` reads one ``strategy()`` example (``scratch``: an empty
    directory of its own); ``reads``: what it feeds to which reader."""

    name: str
    reads: str
    strategy: Callable[[], Any]
    check: Callable[[Any, Path], None]


def refused(
    read: Callable[[], T], *names: str, errors: tuple[type[BaseException], ...] = (ValueError,)
) -> T | None:
    """``read()``'s value, or None when it raised one of ``errors`` naming every one of
    ``names`` (a path, a key, a line); anything else raises ``FuzzFailure``."""
    try:
        return read()
    except errors as e:
        text = str(e)
        missing = [n for n in names if n not in text]
        if missing:
            raise FuzzFailure(f"{type(e).__name__} does not name {missing}: {text[:500]!r}") from e
        return None
    except FuzzFailure:
        raise
    except Exception as e:
        raise FuzzFailure(f"unhandled {type(e).__name__}: {str(e)[:500]}") from e


_FIXTURES: dict[str, Any] = {}
_FIXTURE_ROOT: dict[str, Any] = {}  # "path" -> the fixtures' folder, "pid" -> its maker


def made_once(name: str, make: Callable[[Path], T]) -> T:
    """``make(folder)``'s value (a trained run, a cache: what many inputs read), made once
    per process in an empty ``folder`` of its own under one temporary folder, which
    ``release_fixtures`` removes (at the latest when the process that made it exits)."""
    if name not in _FIXTURES:
        if not _FIXTURE_ROOT:
            root = Path(tempfile.mkdtemp(prefix="towerrec-fuzz-fixtures-"))
            _FIXTURE_ROOT.update(path=root, pid=os.getpid())
            atexit.unregister(release_fixtures)  # once, however often released
            atexit.register(release_fixtures)
        folder = _FIXTURE_ROOT["path"] / name
        shutil.rmtree(folder, ignore_errors=True)  # a make that failed part way
        folder.mkdir()
        _FIXTURES[name] = make(folder)
    return _FIXTURES[name]


def release_fixtures() -> None:
    """Forget what ``made_once`` made and remove its folder (in the process that made it
    only: a forked child exiting leaves its parent's fixtures in place)."""
    if _FIXTURE_ROOT.get("pid") != os.getpid():
        return
    _FIXTURES.clear()
    shutil.rmtree(_FIXTURE_ROOT.pop("path"), ignore_errors=True)
    _FIXTURE_ROOT.clear()


@contextmanager
def _time_limit(cpu_s: float, wall_s: float) -> Iterator[None]:
    """Fail an example that spends ``cpu_s`` seconds of CPU (SIGPROF), or waits ``wall_s``
    seconds in all (SIGALRM: a deadlock uses no CPU). CPU time, not the clock, is the
    main limit, so that a busy machine cannot make a slow example look like a hang.
    Main thread only (else no limit)."""

    def expired(signum: int, frame: Any) -> None:
        if signum == signal.SIGPROF:
            raise FuzzFailure(f"an example used {cpu_s:g} s of CPU: a hang")
        raise FuzzFailure(f"an example waited {wall_s:g} s: a hang")

    try:
        previous = {n: signal.signal(n, expired) for n in (signal.SIGPROF, signal.SIGALRM)}
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_target(
    target: FuzzTarget, examples: int, seed: int | None = None, raise_failure: bool = True
) -> dict[str, Any]:
    """Run ``examples`` inputs through ``target`` (derandomized unless ``seed`` is given);
    the count tried (shrinking included) and the seconds taken. A failure is raised
    (``raise_failure``) or returned as ``failure`` with its minimal example."""
    import hypothesis
    from hypothesis import HealthCheck, given, settings

    tried = 0
    failing: list[Any] = []
    with tempfile.TemporaryDirectory(prefix=f"towerrec-fuzz-{target.name}-") as tmp:
        root = Path(tmp)

        @settings(
            max_examples=examples,
            derandomize=seed is None,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            report_multiple_bugs=False,
        )
        @given(target.strategy())
        def check(example: Any) -> None:
            nonlocal tried
            tried += 1
            scratch = root / str(tried)
            scratch.mkdir()
            failing[:] = [example]
            try:
                with _time_limit(HANG_S, HANG_WALL_S), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a reader's warnings are not failures
                    target.check(example, scratch)
            except FuzzFailure:
                raise
            except Exception as e:  # raised outside ``refused``: unhandled all the same
                raise FuzzFailure(f"unhandled {type(e).__name__}: {str(e)[:500]}") from e
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

        if seed is not None:
            check = hypothesis.seed(seed)(check)
        start = time.perf_counter()
        result: dict[str, Any] = {"reads": target.reads}
        try:
            check()
        except Exception as e:
            if raise_failure:
                raise
            result["failure"] = f"{type(e).__name__}: {str(e)[:1000]}"
            result["example"] = repr(failing[0])[:2000] if failing else None
        result.update(examples=tried, seconds=round(time.perf_counter() - start, 2))
    return result
