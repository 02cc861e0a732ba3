"""The library's choices and defaults that the command line's help shows, as plain data.

Building the parser (``towerrec --help``, ``towerrec train --help``) imports no
library module that imports torch or numpy; the values the help shows are copied
here instead, and tests/test_cli_imports.py checks that each equals the library's own.
"""

from __future__ import annotations

__all__ = [
    "EXPORT_TABLE_DTYPES",
    "NAS_SPACES",
    "PREDICT_SPLITS",
    "PROFILE_MAX_IDS",
    "PROFILE_NAME",
    "PU_FOLDS",
    "PU_TOP_FRACTION",
]

# towerrec.serve.export.TableDtype: `towerrec export --tables`; the first is the default.
EXPORT_TABLE_DTYPES = ("fp32", "fp16", "int8")
# towerrec.serve.predict.SPLITS: `towerrec predict --split`.
PREDICT_SPLITS = ("validation", "test", "train", "all")
# towerrec.config.nas.SearchSpaceKind: `towerrec nas search --space`.
NAS_SPACES = ("mlp", "emb_dim", "emb_card")
# towerrec.data.profile.DEFAULT_MAX_IDS and PROFILE_NAME: `towerrec data profile`.
PROFILE_MAX_IDS = 4_000_000
PROFILE_NAME = "locality_profile.json"
# towerrec.workflows.pu.prior.FOLDS and TOP_FRACTION: `towerrec data pu-prior`.
PU_FOLDS = 5
PU_TOP_FRACTION = 0.02
