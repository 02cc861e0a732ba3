"""Workflows: what a run does around the training engine (``towerrec.train``).

Each is a room of its own above the engine and the build layer (``towerrec.build``),
and the engine imports none of them (tests/test_layering.py):

- ``training.py``: ``train(config, out_dir)``, the full run of ``towerrec train``:
  it builds the objective, the step strategy and the hooks the config asks for
  and hands them to the engine; ``worker.py`` is its ``--nproc`` worker
- ``replay/``: rolling evaluation over time-ordered periods (``towerrec replay``)
  and its update strategies (``temporal.py``)
- ``distill/``: external distillation (the loss, the adapter's own pass, teacher
  periods) and the augmentation service (``towerrec distill serve``)
- ``pu/``: the class prior of positive-unlabeled data and the run's objective
- ``prune_grow.py``: growth and pruning of hidden layers, a step hook
- ``sampled.py``: the step strategy of the optimizers that draw their own samples
- ``sweep.py``: grids of runs for scaling-law fits (``towerrec sweep``)
- ``nas/``: differentiable architecture search (``towerrec nas``)
"""
