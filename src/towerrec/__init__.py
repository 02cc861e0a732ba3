"""towerrec: train DLRM-family recommendation models from one CPU core to many GPU hosts."""

from towerrec.compat import check_versions

check_versions()  # a Python or torch older than supported: a clear error, not a traceback
