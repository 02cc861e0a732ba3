"""The ``towerrec`` command line, one module per command group.

    app.py      main(): the parser of every group, logging, user errors, a closed stdout
    train.py    towerrec train (one process, --nproc N local workers, or a torchrun worker)
    config.py   towerrec config show
    plan.py     towerrec plan (and --calibrate)
    data.py     towerrec data criteo | libfm | table | gen-criteo | info
    bench.py    towerrec bench NAME: the one table of benchmarks (towerrec.bench), JSON out
    common.py   the --config / --set arguments

Nothing in the library imports this package (tests/test_layering.py); the
``towerrec`` script is ``towerrec.cli:main``.
"""

from towerrec.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
