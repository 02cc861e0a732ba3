"""The training engine: a run's session (``session.py``), the loop and its end
(``loop.py``), the step hooks it speaks to (``hooks.py``), checkpoints, the run
directory, the summary, early stopping, the pipeline and a process's run context.

Its floor, the step primitives (``step.py``, ``loss.py``, ``metrics.py``), imports
nothing else of it, so the build layer (``towerrec.build``) below the rest uses them.
The workflows (``towerrec.workflows``) sit above; the engine imports none of them.
"""
