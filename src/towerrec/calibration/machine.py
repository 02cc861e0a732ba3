"""What machine a measurement ran on: date, CPU model, cores, threads, versions."""

from __future__ import annotations

import os
import platform
from datetime import date

import torch

from towerrec.hardware import cpu_model

__all__ = ["machine_info"]


def machine_info() -> dict:
    return {
        "date": date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
