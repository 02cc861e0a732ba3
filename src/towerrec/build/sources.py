"""A run's data from its ``[data]`` section, through the registry of sources
(``towerrec.data.registry.SOURCES``): its splits (``build_source``) or its time-ordered
periods (``build_periods``, for ``towerrec replay``)."""

from __future__ import annotations

from towerrec.config import DataConfig
from towerrec.data.periods import PeriodSource
from towerrec.data.registry import SOURCES
from towerrec.data.source import DataSource

__all__ = ["build_periods", "build_source"]


def build_source(config: DataConfig) -> DataSource:
    """The source of ``data.source``: train, validation and test splits."""
    return SOURCES[config.source].build(config)


def build_periods(config: DataConfig) -> PeriodSource:
    """The periods of ``data.source`` (``data/periods.py``)."""
    return SOURCES[config.source].periods(config)
