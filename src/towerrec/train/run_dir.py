"""A run directory: the resolved config, metrics, summary, curves and checkpoints.

::

    <out>/config.toml      resolved config (``towerrec train --config <out>/config.toml``
                           reproduces the run)
    <out>/metrics.jsonl    one JSON object per logging or evaluation step
    <out>/summary.json     final metrics, throughput, sizes
    <out>/curves.png       training loss and eval AUC over steps
    <out>/checkpoint/      DCP checkpoints (step_<N>/)
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from towerrec.config import Config, config_to_toml

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
    def __init__(self, path: str | Path, *, writer: bool = True) -> None:
        self.path = Path(path)
        self.writer = writer  # only one process of a distributed run writes files

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def start(self, config: Config, *, resume: bool) -> None:
        """Create the directory; refuse to overwrite a run unless resuming it."""
        if not resume and (self.metrics_path.exists() or self.checkpoint_dir.exists()):
            raise FileExistsError(
                f"{self.path} already holds a run; pass --resume to continue it, or choose "
                "another --out"
            )
        if not self.writer:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.toml").write_text(config_to_toml(config))
        if not resume:
            self.metrics_path.write_text("")

    def log(self, record: dict[str, Any]) -> None:
        if self.writer:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(_json_safe(record)) + "\n")

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
