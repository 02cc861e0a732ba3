"""``python -m towerrec``: the ``towerrec`` command."""

import sys

from towerrec.cli.app import main

sys.exit(main())
