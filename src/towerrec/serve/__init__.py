"""Serving a trained run: ``export`` (an inference artefact), ``predict`` (scoring data
with it) and ``artefact`` (the loader, which imports no towerrec; docs/serving.md)."""
