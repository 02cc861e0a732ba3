"""Measuring this machine's kernels and collectives for the planner's cost model.

The planner is pure (planner/cost.py reads constants, it measures nothing);
this package runs the real embedding kernels (modules/) and gloo collectives
(distributed/) and writes the constants it reads: ``towerrec plan --calibrate``
calls ``calibrate`` and saves its JSON, ``plan.calibration`` points at it.

    kernels.py       synthetic devices, timed forward + backward + fused update;
                     the analytic cost's features and their non-negative fit
    collectives.py   gloo all-to-all between two local processes
    storage.py       SSD bandwidths and 4 KiB read latency, host memory copies (tiers)
    constants.py     calibrate(): both measurements fitted into CostConstants
    machine.py       what machine a measurement ran on

It sits above modules/, distributed/ and planner/ and below the command line
and the benchmarks (``towerrec bench costmodel`` and ``bench plan`` time
devices with it); tests/test_layering.py keeps it there.
"""

from towerrec.calibration.collectives import measure_all_to_all
from towerrec.calibration.constants import calibrate
from towerrec.calibration.kernels import (
    FEATURES,
    analytic_device_seconds,
    device_step,
    fit_kernel,
    kernel_features,
    make_ids,
    measure_device,
    random_device,
    random_table,
)
from towerrec.calibration.machine import machine_info
from towerrec.calibration.storage import measure_storage

__all__ = [
    "FEATURES",
    "analytic_device_seconds",
    "calibrate",
    "device_step",
    "fit_kernel",
    "kernel_features",
    "machine_info",
    "make_ids",
    "measure_all_to_all",
    "measure_device",
    "measure_storage",
    "random_device",
    "random_table",
]
