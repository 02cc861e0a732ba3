"""Positive-unlabeled learning: the class prior estimated from held-out scores, and the
run's objective (``prior.py``); the PU losses themselves are the engine's
(``towerrec.train.loss``). docs/pu_learning.md has the math."""
