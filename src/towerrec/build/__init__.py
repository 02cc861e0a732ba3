"""The build layer: from a run config to the objects a run is made of, between the
config (below) and the training engine (``towerrec.train``, above).

- ``run.py``: ``build_run(config, ...)``, what every place that trains starts from:
  the data, the model (a DMT's learned partition resolved, laid out over the ranks),
  the dense optimizer, the device
- ``sources.py``: the data, through the registry of sources (``towerrec.data.registry``)
- ``models.py``: ``MODELS``, one builder per ``model.name``; the distillation heads
- ``optimizers.py``: ``DENSE_OPTIMIZERS``, one builder per ``optimizer.name``
- ``resolve.py``: the device, the number of steps, the validation interval
- ``planning.py``: the sharding plan of a run (``plan.strategy``)
- ``towers.py``: the DMT's learned tower partition (a short pilot run)

It uses the engine's step primitives (``towerrec.train.step``, ``loss``, ``metrics``)
for the pilot run and nothing else of the engine (tests/test_layering.py).
"""
