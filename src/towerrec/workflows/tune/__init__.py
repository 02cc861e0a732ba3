"""``towerrec tune``: hyperparameter search on the validation split with Optuna.

space.py        the TOML space and the study's settings, checked before any trial
study.py        the study (SQLite, resumable), its trials, one run directory each
report_hook.py  the step hook that reports validations and prunes a trial
worker.py       one trial's training, here or in each worker of --nproc
report.py       the table of trials, the plot and the best config
"""
