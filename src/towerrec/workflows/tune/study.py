"""``towerrec tune``: an Optuna study over a declared space, one run directory per trial.

::

    OUT/study.db         the study (Optuna's RDB storage on SQLite): every trial's drawn
                         values, its reported validations and its result
    OUT/study.lock       held while a tuner works on OUT (a second one is refused)
    OUT/trial-NNN/       trial NNN's run directory, as `towerrec train --out` writes it
    OUT/trials.csv       the table of trials; trials.png the metric over trials;
    OUT/best.toml        the best trial's config (`towerrec train --config OUT/best.toml`)

A trial draws its values (TPE, seeded), trains the base config with them as overrides
(in this process, or on ``nproc`` workers as ``towerrec train --nproc`` starts them),
reports every validation to the study through a step hook (``report_hook.py``), which
prunes a trial that falls behind, and ends with the metric of the weights the run
returns (with early stopping: its best validation's).

Resume: the study is in its file, so running the same command again continues it. A
trial that was running when the tuner died (a kill, a crash) is continued under its own
number with its own values: from its last checkpoint when it has one, else anew; the
finished trials stay as they are. ``--trials`` counts every trial of the study. A study
file of another space, data set or base config is refused, naming what differs; one
SQLite cannot read whole (cut short, overwritten) is refused naming the file.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import logging
import shutil
import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from towerrec.config import ConfigFiles, config_to_dict, load_config
from towerrec.distributed.launch import WorkerError, launch
from towerrec.train.checkpoint import CheckpointManager
from towerrec.train.run_dir import RunDir
from towerrec.workflows.tune.report_hook import TrialLink, import_optuna
from towerrec.workflows.tune.space import Choice, Space
from towerrec.workflows.tune.worker import tune_worker

__all__ = ["StudyRun", "run_study"]

log = logging.getLogger("towerrec")

STUDY_NAME = "towerrec"


@dataclass(frozen=True)
class StudyRun:
    """What a tuner works with: the base config, the space and where it all goes."""

    config_files: ConfigFiles
    overrides: tuple[str, ...]
    space: Space
    out: Path
    nproc: int = 1
    hosts: int = 1

    @property
    def storage(self) -> str:
        """Optuna's URL of ``OUT/study.db``: a SQLite URI filename escaped twice
        (SQLAlchemy unescapes the URL once, SQLite the URI), so that a ``?``, ``#`` or
        ``%`` in the path names the file rather than starting a query."""
        path = (self.out / "study.db").resolve().as_uri().removeprefix("file://")
        return f"sqlite:///file:{urllib.parse.quote(path, safe='/')}?uri=true"

    def trial_dir(self, number: int) -> Path:
        return self.out / f"trial-{number:03d}"


# ------------------------------------------------------------------ the study file
@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold ``OUT/study.lock`` (released by the OS when the process dies, even by SIGKILL)."""
    with open(out / "study.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"another towerrec tune is working on {out}; wait for it, or use another --out"
            ) from None
        yield


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Keys that change how a run looks or runs, not what it learns: a resumed study may
# change them (e.g. --set train.progress=false, more loader workers).
_PRESENTATION = (
    "train.progress",
    "train.log_every",
    "train.tensorboard",
    "train.threads",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "data.loader.verify",
    "data.loader.num_workers",
    "data.loader.prefetch",
    "data.loader.pin_memory",
)


def _identity(run: StudyRun) -> dict[str, Any]:
    """What makes trials comparable: the space, the metric and the base config."""
    first = {p.key: p.values()[0] for p in run.space.params}  # a base may need them to load
    config = load_config(run.config_files, [*run.overrides, *run.space.overrides(first)])
    searched = [*_PRESENTATION, *first]
    base = {
        k: v
        for k, v in _flat(config_to_dict(config)).items()
        if not any(k == p or fnmatch.fnmatchcase(k, p) for p in searched)
    }
    identity = {"space": run.space.as_dict(), "metric": run.space.study.metric, "base": base}
    return json.loads(json.dumps(identity))  # as the study file stores it


def _check_identity(study: Any, identity: dict[str, Any], db: Path) -> None:
    """Refuse a study file made for another space, metric, data set or base config."""
    stored = study.user_attrs.get("towerrec")
    if stored is None:
        if study.trials:
            raise ValueError(f"{db} holds an Optuna study that towerrec tune did not make")
        study.set_user_attr("towerrec", identity)
        return
    fix = "use another --out, or delete the study file to start over"
    if stored["space"] != identity["space"]:
        keys = sorted(
            k
            for k in stored["space"].keys() | identity["space"].keys()
            if stored["space"].get(k) != identity["space"].get(k)
        )
        raise ValueError(f"{db} is a study of another space (it differs in {keys}); {fix}")
    if stored["metric"] != identity["metric"]:
        raise ValueError(
            f"{db} is a study of validation {stored['metric']}, not {identity['metric']}; {fix}"
        )
    old, new = stored["base"], identity["base"]
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    data = [k for k in changed if k.startswith("data.")]
    if data:
        detail = ", ".join(f"{k} was {old.get(k)!r}, now {new.get(k)!r}" for k in data)
        raise ValueError(f"{db} is a study of another data set ({detail}); {fix}")
    if changed:
        detail = ", ".join(f"{k} was {old.get(k)!r}, now {new.get(k)!r}" for k in changed)
        raise ValueError(f"{db} is a study of another base config ({detail}); {fix}")


def _check_database(db: Path) -> None:
    """Refuse a study file SQLite cannot read whole (cut short, overwritten, not SQLite):
    Optuna's own error names neither the file nor the fix. SQLite's ``quick_check``
    reads every page of the file's structure; a value changed inside a valid page is
    not caught (docs/reliability.md)."""
    if not db.is_file():
        return
    fix = "move it away to start a new study (the trials' run directories stay)"
    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            found = [row[0] for row in conn.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{db} is not a readable study database ({e}); {fix}") from None
    if found != ["ok"]:
        detail = "; ".join(str(x) for x in found[:3])
        raise ValueError(f"{db} is damaged (SQLite's check: {detail}); {fix}")


def _open_study(run: StudyRun) -> Any:
    optuna = import_optuna()
    _check_database(run.out / "study.db")
    settings = run.space.study
    study = optuna.create_study(
        storage=run.storage,
        study_name=STUDY_NAME,
        direction=settings.direction,
        sampler=optuna.samplers.TPESampler(seed=settings.seed),
        pruner=_link(run, -1).make_pruner(),
        load_if_exists=True,
    )
    _check_identity(study, _identity(run), run.out / "study.db")
    return study


def _link(run: StudyRun, trial_id: int) -> TrialLink:
    s = run.space.study
    return TrialLink(
        run.storage,
        STUDY_NAME,
        trial_id,
        s.metric,
        s.pruner,
        s.startup_trials,
        s.warmup_validations,
    )


# ------------------------------------------------------------------ values
def _encode(value: Any) -> Any:
    """A choice as Optuna stores it (numbers, strings, booleans; a list as its JSON)."""
    return value if isinstance(value, bool | int | float | str) else json.dumps(value)


def distributions(space: Space) -> dict[str, Any]:
    optuna = import_optuna()
    out: dict[str, Any] = {}
    for p in space.params:
        if isinstance(p, Choice):
            out[p.key] = optuna.distributions.CategoricalDistribution(
                [_encode(c) for c in p.choices]
            )
        elif p.integer:
            step = int(p.step) if p.step is not None else 1
            out[p.key] = optuna.distributions.IntDistribution(
                int(p.low), int(p.high), log=p.log, step=step
            )
        else:
            out[p.key] = optuna.distributions.FloatDistribution(
                p.low, p.high, log=p.log, step=p.step
            )
    return out


def decoded(space: Space, params: dict[str, Any]) -> dict[str, Any]:
    """A trial's Optuna params as config values."""
    out = {}
    for p in space.params:
        value = params[p.key]
        if isinstance(p, Choice):
            value = next(c for c in p.choices if _encode(c) == value)
        out[p.key] = value
    return out


# ------------------------------------------------------------------ trials
def _train_trial(run: StudyRun, number: int, trial_id: int, params: dict[str, Any]) -> dict:
    """Train trial ``number`` (resuming its run from a checkpoint when it has one): rank
    0's result (``worker.py``), the run's summary or ``{"pruned": validation}``."""
    out = run.trial_dir(number)
    summary = out / "summary.json"
    if summary.is_file():  # the run ended, the tuner died before it told the study
        done = RunDir(out).read_summary()
        if done.get("completed"):
            return done
    overrides = [*run.overrides, *run.space.overrides(decoded(run.space, params))]
    resume = CheckpointManager(RunDir(out).checkpoint_dir).latest() is not None
    if out.exists() and not resume:  # started before, nothing saved: start it anew
        shutil.rmtree(out)
    if resume:
        log.info("trial %d: resuming its run from its last checkpoint", number)
        config_files, overrides = None, []  # the run's saved config.toml is its config
    else:
        config_files = run.config_files
    args = (config_files, overrides, out, resume, _link(run, trial_id))
    if run.nproc == 1 and run.hosts == 1:
        result = tune_worker(*args)
    else:
        try:
            result = launch(tune_worker, args, run.nproc, run.hosts)[0]
        except WorkerError as e:
            raise RuntimeError(f"a worker failed: {e}") from None
    assert result is not None  # rank 0's
    return result


def _run_trial(study: Any, run: StudyRun, trial: Any) -> bool:
    """Run ``trial`` (an ``optuna.Trial``) to its end and tell the study; False when a
    signal stopped it (it stays running in the study, and continues when the tuner runs
    again)."""
    optuna = import_optuna()
    number, values = trial.number, decoded(run.space, trial.params)
    log.info("trial %d: %s", number, " ".join(run.space.overrides(values)))
    try:
        result = _train_trial(run, number, trial._trial_id, trial.params)
    except Exception as e:  # a failing trial is recorded; the study goes on
        log.warning("trial %d failed: %s", number, e)
        trial.set_user_attr("error", f"{type(e).__name__}: {e}")
        study.tell(number, state=optuna.trial.TrialState.FAIL)
        return True
    if "pruned" in result:
        log.info("trial %d pruned at validation %d", number, result["pruned"])
        study.tell(number, state=optuna.trial.TrialState.PRUNED)
        return True
    if not result["completed"]:
        log.warning("trial %d stopped by a signal; run the same command to continue it", number)
        return False
    value = result.get(run.space.study.metric)
    if value is None:  # e.g. no validation split
        log.warning("trial %d has no validation %s", number, run.space.study.metric)
        trial.set_user_attr("error", f"the run reported no validation {run.space.study.metric}")
        study.tell(number, state=optuna.trial.TrialState.FAIL)
        return True
    study.tell(number, float(value))
    return True


def run_study(run: StudyRun, trials: int | None = None) -> Any:
    """Run the study until it holds ``trials`` trials (default: the space's), continuing
    an interrupted one first (module doc); the study."""
    optuna = import_optuna()
    if run.nproc < 1 or run.hosts < 1 or run.nproc % run.hosts:
        raise ValueError(
            f"--nproc {run.nproc} and --hosts {run.hosts}: both must be >= 1 and the hosts "
            "must divide the processes"
        )
    total = trials if trials is not None else run.space.study.trials
    if total < 1:
        raise ValueError(f"--trials must be >= 1, got {total}")
    run.space.check(run.config_files, run.overrides)  # a bad key fails before any trial
    run.out.mkdir(parents=True, exist_ok=True)
    with _locked(run.out):
        study = _open_study(run)
        running = optuna.trial.TrialState.RUNNING
        for frozen in study.get_trials(deepcopy=False, states=(running,)):
            if not _run_trial(study, run, optuna.trial.Trial(study, frozen._trial_id)):
                return study
        space = distributions(run.space)
        while len(study.get_trials(deepcopy=False)) < total:
            if not _run_trial(study, run, study.ask(space)):
                break
    return study
