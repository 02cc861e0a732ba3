"""The step hook that reports a trial's validations to its Optuna study and prunes it.

At each validation, rank 0 reports the metric to the trial (step: the validation's
index, 1, 2, ..., so that trials of different batch sizes meet at the same epochs when
``train.eval_every = "epoch"``) and asks the study's pruner whether the trial falls
behind; the ranks agree on the answer (``RunContext.stop_agreed``: one all-reduce, as
for a stop signal) and every rank raises ``TrialPruned`` at the same step. The study
lives in its SQLite file, so a worker process of ``--nproc`` reaches it as the tuning
process does (``TrialLink``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from towerrec.train.hooks import StepHook
from towerrec.train.metrics import EvalMetrics

if TYPE_CHECKING:
    import optuna

    from towerrec.train.session import Session

__all__ = ["TrialLink", "TrialPruned", "TrialReport", "import_optuna"]


class TrialPruned(Exception):
    """The study pruned this trial at a validation: its run stops there."""

    def __init__(self, validation: int, value: float) -> None:
        super().__init__(f"pruned at validation {validation} ({value:.5f})")
        self.validation, self.value = validation, value


def import_optuna() -> Any:
    """Optuna, an optional dependency (the ``tune`` extra)."""
    try:
        import optuna
    except ImportError:
        raise ImportError(
            "towerrec tune searches with Optuna: pip install 'towerrec[tune]' (or optuna)"
        ) from None
    return optuna


@dataclass(frozen=True)
class TrialLink:
    """Where a trial lives: its study's storage and name, the trial's id, the metric and
    the pruner's settings (plain data: a ``--nproc`` worker gets it pickled)."""

    storage: str  # Optuna URL of the study file (``StudyRun.storage``)
    study_name: str
    trial_id: int
    metric: str
    pruner: str  # median | none
    startup_trials: int
    warmup_validations: int

    def make_pruner(self) -> optuna.pruners.BasePruner:
        optuna = import_optuna()
        if self.pruner == "none":
            return optuna.pruners.NopPruner()
        # validations are reported as steps 1, 2, ...; Optuna prunes from n_warmup_steps on
        return optuna.pruners.MedianPruner(
            n_startup_trials=self.startup_trials, n_warmup_steps=self.warmup_validations + 1
        )

    def open(self) -> optuna.Trial:
        optuna = import_optuna()
        study = optuna.load_study(
            study_name=self.study_name, storage=self.storage, pruner=self.make_pruner()
        )
        return optuna.trial.Trial(study, self.trial_id)


class TrialReport(StepHook):
    """Each validation to the trial; ``TrialPruned`` when the study prunes it (module doc)."""

    def __init__(self, link: TrialLink) -> None:
        self.link = link
        self.trial: optuna.Trial | None = None
        self.validations = 0

    def setup(self, session: Session) -> None:
        self.session = session
        if session.ctx.is_main:
            self.trial = self.link.open()

    def on_start(self, step: int) -> None:
        """A resumed run counts the validations its records already hold."""
        run = self.session.run
        if not self.session.ctx.is_main or not run.metrics_path.is_file():
            return
        records = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line]
        self.validations = sum(
            r.get("kind") == "eval" and r.get("split") == "validation" for r in records
        )

    def on_validation(self, step: int, metrics: EvalMetrics) -> None:
        self.validations += 1
        value = float(metrics.as_dict()[self.link.metric])
        prune = False
        if self.trial is not None:  # rank 0
            done = self.trial.storage.get_trial(self.link.trial_id).intermediate_values
            if self.validations not in done:  # a restarted trial reports each once
                self.trial.report(value, self.validations)
            prune = self.trial.should_prune()
        if self.session.ctx.stop_agreed(prune):
            raise TrialPruned(self.validations, value)
