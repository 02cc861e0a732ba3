"""Sharding planners: pure functions from tables + topology + constraints to a plan.

Nothing here imports torch.distributed or the trainer (tests/test_layering.py).
"""
