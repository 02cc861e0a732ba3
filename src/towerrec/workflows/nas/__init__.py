"""Differentiable architecture search (DNAS) on the DLRM backbone: ``towerrec nas``."""
