#!/usr/bin/env bash
# The GPU check in one command (tools/device_check.py): on a bare GPU machine, with the
# wheels of `python tools/device_check.py wheels` in .whl/, install towerrec, run the
# tests that take a CUDA device and the GPU benchmarks, and write device_check.json and
# pytest.log into OUT (the first argument, else $OUT), in at most 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:?give the output folder as the first argument or in OUT}}"
shift || true
exec python3 tools/device_check.py run --out "$out" "$@"
