"""Time a cache's id -> slot map (``DenseSlotMap``) on 4 KiB pages against 2 MiB pages,
the way a training step uses it: a gather of the batch's scattered ids and two scatters
(the misses' slots set, the victims' cleared), between dense matmuls that push the map's
page-table entries out of the CPU's caches. Prints JSON::

    python tools/slot_map_pages.py [--rows 31000000] [--steps 200] [--rounds 3]

Rows default to the 8 GiB ``bench tiers`` shape's 7 cached tables together (124 MB of
int32). The two maps alternate round by round; each round reports the median step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from towerrec.calibration.machine import machine_info
from towerrec.modules.cache_maps import DenseSlotMap


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``[madvise]``: only advised memory gets
    2 MiB pages, so the plain map stays on 4 KiB pages; ``[always]``: both get them)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=31_000_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ids", type=int, default=4000, help="distinct ids a step")
    args = parser.parse_args()
    torch.set_num_threads(2)
    maps = {
        "4k_pages": torch.full((args.rows,), -1, dtype=torch.int32),
        "huge_pages": DenseSlotMap(args.rows).table,  # what a cache allocates
    }
    a, b = torch.randn(2048, 1024), torch.randn(1024, 1024)
    g = torch.Generator().manual_seed(0)
    set_n = args.ids * 2 // 3
    rounds: dict[str, list[float]] = {k: [] for k in maps}
    for _ in range(args.rounds):
        for name, table in maps.items():
            times = []
            for _ in range(args.steps):
                for _ in range(3):
                    a @ b
                ids = torch.randint(0, args.rows, (args.ids,), generator=g).unique()
                start = time.perf_counter()
                table[ids].long()
                table[ids[:set_n]] = 5
                table[ids[-set_n:]] = -1
                times.append(time.perf_counter() - start)
            rounds[name].append(sorted(times)[len(times) // 2] * 1e3)
    best = {k: min(v) for k, v in rounds.items()}
    print(
        json.dumps(
            {
                "benchmark": "slot_map_pages",
                "machine": machine_info(),
                "transparent_hugepage": _thp_mode(),
                "rows": args.rows,
                "map_mb": round(args.rows * 4 / 2**20, 1),
                "ids_a_step": args.ids,
                "accesses_a_step": args.ids + 2 * set_n,
                "step_ms_by_round": {k: [round(x, 3) for x in v] for k, v in rounds.items()},
                "step_ms_best": {k: round(v, 3) for k, v in best.items()},
                "ratio_4k_to_huge": round(best["4k_pages"] / best["huge_pages"], 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
