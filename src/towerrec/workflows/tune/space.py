"""The search space of ``towerrec tune``: a TOML file, read and checked before any trial.

::

    [study]
    metric = "auc"              # the validation metric: auc (maximised) | logloss (minimised)
    trials = 20                 # trials in the study (--trials overrides)
    seed = 0                    # the sampler's (Optuna's TPE)
    pruner = "median"           # median: prune a trial below the median of the others at
                                # the same validation | none
    startup_trials = 5          # trials that run whole before pruning starts
    warmup_validations = 1      # validations of a trial before it can be pruned

    [space]                     # any config key: a range or a list of choices
    "optimizer.lr" = { low = 1e-4, high = 1e-2, log = true }
    "embedding.lr" = { low = 0.01, high = 1.0, log = true }
    "model.dropout" = { low = 0.0, high = 0.3 }
    "train.batch_size" = { choices = [512, 1024, 2048] }
    "model.top_mlp" = { choices = [[256, 1], [400, 400, 1]] }

A range of integers (both ends integers) draws integers, else floats; ``log = true``
draws on a log scale (both ends > 0), ``step`` on a grid. Keys may also be written as
nested tables (``[space.optimizer] lr = { ... }``). Every key is checked against the
run config with its range's ends and each choice (``Space.check``): an unknown key, an
empty range, a log range through 0 or a value the config refuses is an error naming the
key, before the first trial.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from towerrec.config import ConfigError, ConfigFiles, load_config

__all__ = ["Choice", "Range", "Space", "StudySettings", "load_space", "toml_value"]

_METRICS = ("auc", "logloss")
_PRUNERS = ("median", "none")
_RANGE_FIELDS = {"low", "high", "log", "step"}


def toml_value(value: Any) -> str:
    """``value`` as the right-hand side of a ``--set KEY=VALUE`` (TOML, one line)."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = ") :].strip()


@dataclass(frozen=True)
class Range:
    """``low..high`` (inclusive): integers when both ends are, else floats."""

    key: str
    low: float
    high: float
    log: bool = False
    step: float | None = None

    @property
    def integer(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def values(self) -> list[Any]:
        """The values checked against the config: the two ends."""
        return [self.low, self.high]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"low": self.low, "high": self.high, "log": self.log}
        return out if self.step is None else {**out, "step": self.step}


@dataclass(frozen=True)
class Choice:
    """One of ``choices`` (numbers, strings, booleans or lists such as MLP widths)."""

    key: str
    choices: tuple[Any, ...]

    def values(self) -> list[Any]:
        return list(self.choices)

    def as_dict(self) -> dict[str, Any]:
        return {"choices": list(self.choices)}


@dataclass(frozen=True)
class StudySettings:
    """The ``[study]`` table (module doc)."""

    metric: str = "auc"
    trials: int = 20
    seed: int = 0
    pruner: str = "median"
    startup_trials: int = 5
    warmup_validations: int = 1

    def __post_init__(self) -> None:
        if self.metric not in _METRICS:
            raise ValueError(
                f"tune space: study.metric = {self.metric!r} is not one of auc, logloss "
                "(the validation metric the study optimises)"
            )
        if self.pruner not in _PRUNERS:
            raise ValueError(f"tune space: study.pruner = {self.pruner!r} is not median or none")
        for key in ("trials", "startup_trials", "warmup_validations", "seed"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tune space: study.{key} must be an integer >= 0, got {value!r}")
        if self.trials < 1:
            raise ValueError("tune space: study.trials must be >= 1")

    @property
    def direction(self) -> str:
        return "maximize" if self.metric == "auc" else "minimize"


@dataclass(frozen=True)
class Space:
    """The parameters to search and the study's settings."""

    params: tuple[Range | Choice, ...]
    study: StudySettings = field(default_factory=StudySettings)

    def as_dict(self) -> dict[str, Any]:
        """The space as plain data: what a study file records to recognise its space."""
        return {p.key: p.as_dict() for p in self.params}

    def overrides(self, values: dict[str, Any]) -> list[str]:
        """A trial's ``KEY=VALUE`` overrides from its drawn ``values`` (by key)."""
        return [f"{p.key}={toml_value(values[p.key])}" for p in self.params]

    def check(self, config_files: ConfigFiles, overrides: list[str] | tuple[str, ...]) -> None:
        """Every value a key can take (its range's ends, each choice) on the base config:
        an unknown key, or a value the config refuses, is an error naming the key."""
        base = list(overrides)
        try:
            load_config(config_files, base)
            base_error = None
        except ConfigError as e:  # a searched key may be what makes it valid
            base_error = str(e)
        for param in self.params:
            for value in param.values():
                try:
                    load_config(config_files, [*base, f"{param.key}={toml_value(value)}"])
                except ConfigError as e:
                    if str(e) == base_error:
                        raise ValueError(f"the base config (--config, --set): {e}") from None
                    raise ValueError(f"tune space: {param.key} = {value!r}: {e}") from None


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """``{"optimizer": {"lr": {...}}}`` or ``{"optimizer.lr": {...}}`` -> by dotted key."""
    out = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if not isinstance(value, dict):
            raise ValueError(
                f"tune space: space.{key} = {value!r}: give a range {{ low = ..., high = ... }} "
                "or a list {{ choices = [...] }}"
            )
        if _RANGE_FIELDS & value.keys() or "choices" in value:
            out[key] = value
        else:
            out.update(_flatten(value, f"{key}."))
    return out


def _number(key: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"tune space: {key}: {name} must be a finite number, got {value!r}")
    return value


def _param(key: str, spec: dict[str, Any]) -> Range | Choice:
    if "choices" in spec:
        if set(spec) != {"choices"}:
            raise ValueError(
                f"tune space: {key}: a list of choices takes no {sorted(set(spec) - {'choices'})}"
                " (give either choices or a range low/high)"
            )
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"tune space: {key}: choices must be a non-empty list")
        return Choice(key, tuple(choices))
    unknown = set(spec) - _RANGE_FIELDS
    if unknown or "low" not in spec or "high" not in spec:
        raise ValueError(
            f"tune space: {key}: a range is {{ low = ..., high = ... }} with optional log and "
            f"step, got fields {sorted(spec)}"
        )
    low, high = _number(key, "low", spec["low"]), _number(key, "high", spec["high"])
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise ValueError(f"tune space: {key}: log must be true or false, got {log!r}")
    if low > high:
        raise ValueError(
            f"tune space: {key}: the range low = {low} .. high = {high} is empty; give low < high"
        )
    if low == high:
        raise ValueError(
            f"tune space: {key}: the range low = high = {low} holds one value; set it with "
            f"--set {key}={toml_value(low)} instead"
        )
    if log and low <= 0:
        raise ValueError(
            f"tune space: {key}: a log range must lie above 0, got low = {low}; give a "
            "positive low (e.g. 1e-5) or log = false"
        )
    step = spec.get("step")
    if step is not None:
        step = _number(key, "step", step)
        if step <= 0 or log:
            raise ValueError(f"tune space: {key}: step must be > 0 and cannot go with log = true")
    return Range(key, low, high, log, step)


def load_space(path: str | Path) -> Space:
    """The space in the TOML file at ``path`` (module doc); format errors name the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tune space {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"tune space {str(path)!r} is not valid TOML: {e}") from None
    unknown = set(data) - {"study", "space"}
    if unknown:
        raise ValueError(
            f"tune space {str(path)!r}: unknown table(s) {sorted(unknown)}; it has [study] "
            "and [space]"
        )
    study = data.get("study", {})
    fields = set(StudySettings.__dataclass_fields__)
    if not isinstance(study, dict) or set(study) - fields:
        raise ValueError(
            f"tune space: [study] takes {', '.join(sorted(fields))}; got {sorted(study)}"
        )
    specs = _flatten(data.get("space", {}))
    if not specs:
        raise ValueError(
            f"tune space {str(path)!r} has no parameters: add a [space] table, e.g. "
            '"optimizer.lr" = { low = 1e-4, high = 1e-2, log = true }'
        )
    return Space(tuple(_param(k, v) for k, v in specs.items()), StudySettings(**study))
