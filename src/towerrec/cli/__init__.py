"""The ``towerrec`` command line, one module (or package) per command group.

    app.py      main(): the parser of every group, logging, user errors, a closed stdout
    train.py    towerrec train (one process, --nproc N local workers, or a torchrun worker)
    replay.py   towerrec replay (rolling evaluation over time-ordered periods)
    config.py   towerrec config show
    plan.py     towerrec plan (and --calibrate, --profile's memory tiers,
                collect-costs | train-policy of the learned planners)
    bench.py    towerrec bench NAME: the one table of benchmarks (towerrec.bench), JSON out
    data/       towerrec data: convert.py (criteo | libfm | table | gen-criteo | info),
                pu_prior.py, profile.py, periods.py
    sweep.py    towerrec sweep (a grid of runs into one runs file)
    tune.py     towerrec tune (hyperparameter search with Optuna, resumable)
    scaling.py  towerrec scaling fit (a sweep's runs)
    serve.py    towerrec export and towerrec predict
    nas.py      towerrec nas search | retrain
    distill.py  towerrec distill serve (the augmentation service)
    common.py   the --config / --set arguments, the config a data argument names
    choices.py  the library's values the help shows, as plain data

Building the parser imports nothing heavy: each command imports the library (torch,
numpy, towerrec's modules) when it runs, and ``towerrec bench NAME`` imports NAME's
module alone (tests/test_cli_imports.py). Nothing in the library imports this package
(tests/test_layering.py); the ``towerrec`` script is ``towerrec.cli:main``.
"""

from towerrec.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
