"""Rolling evaluation over time-ordered periods (``towerrec replay``, ``replay.py``) and
the strategies that decide what each period trains on (``temporal.py``)."""
