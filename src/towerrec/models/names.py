"""The models a run config names (``model.name``), declared here, below the config that
checks them; the build layer's ``MODELS`` (``towerrec.build.models``) has one builder
for each name (tests/test_registries.py checks that the two agree)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["REPRESENTATION_MODELS", "ModelName"]


class ModelName(StrEnum):
    DLRM = "dlrm"
    DCN = "dcn"
    WUKONG = "wukong"
    DMT = "dmt"


# The models with a representation (``RepresentationModel``: the DLRM's is its top MLP's
# input), which puNCE's contrastive term and an auxiliary distillation head read.
REPRESENTATION_MODELS = frozenset({ModelName.DLRM})
