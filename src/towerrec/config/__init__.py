"""Typed run configuration: one dataclass per component, loaded from TOML.

A run's config is built from, in order: the defaults below, an optional TOML
file or several (``--config``, repeatable), and ``--set section.key=value`` overrides (values in TOML
syntax; bare words are strings). Unknown keys and bad values raise
``ConfigError`` naming the key and the fix. ``config_to_toml`` writes the
resolved config back, so a run directory's ``config.toml`` reproduces the run.

A resumed run (``towerrec train --resume``) starts from that saved
``config.toml`` instead of the defaults; it may change only the settings in
``RESUME_SAFE_KEYS`` (``resume_changes`` refuses the rest).

Files: ``sections.py`` (the dataclasses and what each accepts; ``training.py`` the
training sections, ``embedding.py`` the ``[embedding]`` section, ``errors.py`` their error), ``files.py``
(TOML, overrides, resume changes).
"""

from towerrec.config.files import (
    ConfigFiles,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    resume_changes,
)
from towerrec.config.sections import (
    RESUME_SAFE_KEYS,
    VALUE_ALIASES,
    Config,
    ConfigError,
    DataConfig,
    DistillConfig,
    DistributedConfig,
    EarlyStoppingConfig,
    EmbeddingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    PlanConfig,
    PruneGrowConfig,
    TemporalConfig,
    TrainConfig,
)

__all__ = [
    "RESUME_SAFE_KEYS",
    "VALUE_ALIASES",
    "Config",
    "ConfigError",
    "ConfigFiles",
    "DataConfig",
    "DistillConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "EmbeddingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PlanConfig",
    "PruneGrowConfig",
    "TemporalConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "resume_changes",
]
