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
    <out>/checksums.json   SHA-256 of config.toml and summary.json (``towerrec/checksums.py``)

config.toml and summary.json are read back: a resume continues with the config, and
export, tune and a resumed tuner take the weights and metrics the summary names. Each
is recorded in checksums.json as it is written, and refused when read back changed
(``RunFileError``): a flipped digit in either would otherwise train with another
learning rate, or export another step's weights, without a word. metrics.jsonl is
appended line by line and rewritten by a resume; a line torn by a crash is dropped, and
any other line that is not JSON is refused with its line number.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from towerrec.checksums import (
    ChecksumError,
    file_digest,
    problems,
    read_checksums,
    write_checksums,
)
from towerrec.config import Config, ConfigFiles, config_to_toml, load_config, resume_changes

__all__ = ["RunDir", "RunFileError", "default_run_dir"]

log = logging.getLogger(__name__)

# What a user can do about each file read back changed (``RunDir.check``).
_FIXES = {
    "config.toml": (
        "a resume may change only some settings, with --set (`towerrec train --help`); to "
        "train with other settings, start a new run from it: towerrec train --config "
        "{path} --out NEW_DIR"
    ),
    "summary.json": (
        "it names the step whose weights the run returned; finish the run again from its "
        "last checkpoint (delete summary.json, then towerrec train --out {run} --resume)"
    ),
}


class RunFileError(ValueError):
    """A run directory's config.toml or summary.json changed since the run wrote it."""


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
        self.check("config.toml")
        return load_config(base=self.config_path)

    def check(self, name: str) -> None:
        """Refuse ``name`` (config.toml or summary.json) when it no longer matches the
        digest recorded as the run wrote it (``RunFileError``); runs written before
        checksums.json was, or without an entry for it, pass."""
        path = self.path / name
        try:
            entries = read_checksums(self.path) or {}
        except ChecksumError as e:
            raise RunFileError(
                f"{e}; it holds the digests of the run's config.toml and "
                "summary.json: restore it, or delete it to skip the check"
            ) from None
        if name in entries and (found := problems(self.path, {name: entries[name]})):
            raise RunFileError(
                f"{path} changed since the run wrote it ({found[0]}); "
                + _FIXES[name].format(path=path, run=self.path)
            )

    def read_summary(self) -> dict[str, Any]:
        """The run's summary.json, checked (``check``); a missing file raises
        ``FileNotFoundError``."""
        path = self.path / "summary.json"
        text = path.read_bytes()
        self.check("summary.json")
        fix = _FIXES["summary.json"].format(path=path, run=self.path)
        try:
            summary = json.loads(text)
        except ValueError as e:
            raise RunFileError(f"{path} is not JSON ({e}); {fix}") from None
        if not isinstance(summary, dict):
            raise RunFileError(f"{path} is not a JSON object; {fix}")
        return summary

    def _record(self, name: str) -> None:
        """Add ``name``'s digest to checksums.json, the other entries kept as they are (a
        summary written later does not bless a config.toml changed since)."""
        try:
            entries = read_checksums(self.path) or {}
        except ChecksumError:
            entries = {}  # damaged: what it held is lost; check() refused it on a resume
        entries[name] = file_digest(self.path / name)
        write_checksums(self.path, entries)

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
        self._record("config.toml")
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
        """metrics.jsonl's records; a last line torn by a crash is dropped (a resume
        rewrites the file), any other line that is not a JSON object is refused."""
        if not self.metrics_path.exists():
            return []
        text = self.metrics_path.read_bytes().decode(errors="replace")
        lines = text.split("\n")
        out = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                record, error = None, str(e)
            else:
                error = "" if isinstance(record, dict) else "not a JSON object"
            if isinstance(record, dict):
                out.append(record)
            elif number == len(lines):  # no newline after it: a write the crash cut short
                log.warning("%s:%d is cut short; dropped it", self.metrics_path, number)
            else:
                raise RunFileError(
                    f"{self.metrics_path}:{number} is not a record ({error}); the file is "
                    "damaged: remove that line (or restore the file) and run again"
                )
        return out

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
            self._record("summary.json")

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
