"""A run directory: the resolved config, metrics, summary, curves and checkpoints.

::

    <out>/config.toml      resolved config (``towerrec train --config <out>/config.toml``
                           reproduces the run); written once, a resume never rewrites it
    <out>/metrics.jsonl    one JSON object per logging or evaluation step, and one per
                           resume with the settings it changed
    <out>/summary.json     final metrics, throughput, sizes
    <out>/curves.png       training loss and eval AUC over steps
    <out>/tensorboard/     TensorBoard event files of the same records (train.tensorboard)
    <out>/checkpoint/      DCP checkpoints (step_<N>/)
    <out>/best/            with early stopping: the best validation step's checkpoint (step_<N>/)
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from towerrec.config import Config, ConfigFiles, config_to_toml, load_config, resume_changes

__all__ = ["RunDir", "default_run_dir"]


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("train-%Y%m%d-%H%M%S")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


class RunDir:
    def __init__(self, path: str | Path, *, writer: bool = True, tensorboard: bool = False) -> None:
        self.path = Path(path)
        self.writer = writer  # only one process of a distributed run writes files
        self.tensorboard = tensorboard
        self._events: Any = None  # the TensorBoard SummaryWriter, opened by ``start``
        if tensorboard and writer and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "train.tensorboard = true needs the tensorboard package: "
                "pip install 'towerrec[tensorboard]', or set train.tensorboard = false"
            )

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def best_dir(self) -> Path:
        return self.path / "best"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    def resume_config(
        self, path: ConfigFiles = None, overrides: list[str] | tuple[str, ...] = ()
    ) -> Config:
        """The config a resumed run continues with: its saved config.toml, then the TOML
        file at ``path`` and ``overrides`` on top, which may change only
        ``RESUME_SAFE_KEYS``."""
        self._saved_config()  # a clear error where there is no run
        config = load_config(path, overrides, base=self.config_path)
        self.resume_changes(config)
        return config

    def resume_changes(
        self, config: Config, saved_as: Callable[[Config], Config] | None = None
    ) -> dict[str, dict[str, Any]]:
        """The settings ``config`` changes of the run's saved config.toml (only
        ``RESUME_SAFE_KEYS`` may change; ``ConfigError`` names any other). ``saved_as``
        maps the saved config first (e.g. an ``auto`` setting a run written before
        choices were recorded holds, read as the value this resume chose)."""
        saved = self._saved_config()
        return resume_changes(saved_as(saved) if saved_as else saved, config)

    def _saved_config(self) -> Config:
        if not self.config_path.is_file():
            raise FileNotFoundError(
                f"--resume: {self.path} has no config.toml, so it holds no run to continue; "
                "start a new run without --resume"
            )
        return load_config(base=self.config_path)

    def start(self, config: Config, *, resume: bool) -> None:
        """Create the directory; refuse to overwrite a run unless resuming it. A resumed
        run keeps its config.toml (what changed goes into metrics.jsonl)."""
        if not resume and (self.metrics_path.exists() or self.checkpoint_dir.exists()):
            raise FileExistsError(
                f"{self.path} already holds a run; pass --resume to continue it, or choose "
                "another --out"
            )
        if not self.writer or resume:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config_to_toml(config))
        self.metrics_path.write_text("")

    def open_events(self, step: int) -> None:
        """Start TensorBoard event files (``train.tensorboard``) at ``step``: a resumed run
        purges the events past its checkpoint step, as ``truncate_after`` does for
        metrics.jsonl."""
        if self.writer and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._events = SummaryWriter(str(self.tensorboard_dir), purge_step=step or None)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.writer:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(_json_safe(record)) + "\n")
        if self._events is not None and "step" in record:
            # each number as "<kind>/<key>" (train/loss, eval/auc, ...), at once on disk so
            # a running TensorBoard shows it
            for key, value in record.items():
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if key != "step" and number and math.isfinite(value):
                    self._events.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            self._events.flush()

    def records(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run re-logs the steps it redoes)."""
        if self.writer and self.metrics_path.exists():
            kept = [r for r in self.records() if r.get("step", 0) <= step]
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.writer:
            (self.path / "summary.json").write_text(
                json.dumps(_json_safe(summary), indent=2) + "\n"
            )

    def plot_curves(self, oracle_auc: float | None = None) -> Path | None:
        if not self.writer:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        train = [r for r in records if r.get("kind") == "train"]
        evals = [r for r in records if r.get("kind") == "eval" and r.get("auc") is not None]
        fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 4))
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
        if evals:
            ax_loss.plot(
                [r["step"] for r in evals], [r["logloss"] for r in evals], "o-", label="eval"
            )
        ax_loss.set(xlabel="step", ylabel="log-loss", title="loss")
        ax_loss.legend()
        ax_auc.plot([r["step"] for r in evals], [r["auc"] for r in evals], "o-", label="eval AUC")
        if oracle_auc is not None:
            ax_auc.axhline(
                oracle_auc, color="gray", linestyle="--", label=f"oracle {oracle_auc:.4f}"
            )
        ax_auc.set(xlabel="step", ylabel="AUC", title="eval AUC")
        ax_auc.legend()
        fig.tight_layout()
        out = self.path / "curves.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
