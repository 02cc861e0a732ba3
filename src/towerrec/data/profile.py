"""The locality profile of a data source's tables, what the tier planner reads.

``profile_source`` reads the training stream in the order training reads it
(``train_batches``: the loader's shuffled blocks for a cache, the stream for
synthetic data), one epoch (or ``samples`` samples of an endless stream), and
per table (one per sparse feature) keeps (reading stops early once every table
has its ``max_ids``: the rest of the epoch is then extrapolated from the mean)

    distinct ids per batch       mean, p50, p99, max over the batches read
    the id stream                its first ``max_ids`` ids (the sample), whose
                                 LRU stack distances give the histogram and the
                                 hit-rate curve (data/locality.py)

A ``LocalityProfile`` is JSON (``save``/``load``, format ``FORMAT``) with a
``TableLocality`` per table and the SHA-256 of its other keys (``profile_sha256``):
a changed number is refused at load (profiles without it, from earlier versions,
load). ``report_table`` is the readable view and ``write_plot`` the PNG (hit rate
against cache share, distance histograms).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from towerrec.checksums import sealed, unseal
from towerrec.data.batch import Batch, DataSchema
from towerrec.data.locality import CACHE_FRACTIONS, HIT_TARGETS, TableLocality, summarize

__all__ = [
    "DEFAULT_MAX_IDS",
    "FORMAT",
    "PROFILE_NAME",
    "LocalityProfile",
    "ProfileError",
    "profile_source",
    "report_table",
    "write_plot",
]

FORMAT = "towerrec-locality-profile"
VERSION = 1
DEFAULT_MAX_IDS = 4_000_000
PROFILE_NAME = "locality_profile.json"  # the file's name inside a cache directory
SELF_DIGEST = "profile_sha256"  # the file's digest of its own other keys


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class LocalityProfile:
    source: str
    batch_size: int
    samples_profiled: int
    samples_total: int  # the stream profiled: one epoch, or the run's samples (endless)
    max_ids: int
    tables: tuple[TableLocality, ...]

    def table(self, name: str) -> TableLocality:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "batch_size": self.batch_size,
            "samples_profiled": self.samples_profiled,
            "samples_total": self.samples_total,
            "max_ids": self.max_ids,
            "tables": [t.as_dict() for t in self.tables],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(sealed(self.as_dict(), SELF_DIGEST), indent=1) + "\n")
        tmp.replace(path)
        return path

    @staticmethod
    def load(path: str | Path) -> LocalityProfile:
        path = Path(path)
        if path.is_dir():
            path = path / PROFILE_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"locality profile {str(path)!r} does not exist; write one with "
                "`towerrec data profile DATA --out FILE`"
            )
        try:
            data = json.loads(path.read_text())
        except ValueError as e:  # not JSON, or not UTF-8
            raise ProfileError(
                f"locality profile {path} is not valid JSON ({e}); profile the data again"
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(
                f'{path} is not a locality profile (no "format": "{FORMAT}"); write one '
                "with `towerrec data profile DATA --out FILE`"
            )
        if data.get("version") != VERSION:
            raise ProfileError(
                f"{path} is a version {data.get('version')} locality profile; this towerrec "
                f"reads version {VERSION}: profile the data again"
            )
        if not unseal(data, SELF_DIGEST):
            raise ProfileError(
                f"{path} does not match its own {SELF_DIGEST}: the profile is damaged or was "
                "edited (its counts and hit rates cannot be trusted); profile the data again"
            )
        try:
            tables = tuple(TableLocality.from_dict(t) for t in data["tables"])
            return LocalityProfile(
                source=str(data["source"]),
                batch_size=int(data["batch_size"]),
                samples_profiled=int(data["samples_profiled"]),
                samples_total=int(data["samples_total"]),
                max_ids=int(data["max_ids"]),
                tables=tables,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(
                f"locality profile {path} is incomplete or garbled ({type(e).__name__}: {e}); "
                "profile the data again"
            ) from None


def _num_batches(train_rows: int | None, samples: int | None, batch_size: int) -> int:
    total = train_rows if train_rows is not None else samples
    if total is None:
        raise ValueError(
            "an endless stream (synthetic data) needs the number of samples to profile"
        )
    return max(1, math.ceil(total / batch_size))


def profile_source(
    source: Any,
    *,
    batch_size: int,
    max_ids: int = DEFAULT_MAX_IDS,
    samples: int | None = None,
    description: str = "",
    progress: bool = False,
) -> LocalityProfile:
    """Profile every sparse feature of ``source`` (a ``DataSource``) over one epoch of its
    training split, or ``samples`` samples of an endless stream (module docstring)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if max_ids < 1:
        raise ValueError(f"--max-ids must be >= 1, got {max_ids}")
    schema: DataSchema = source.schema
    train_rows = source.train_rows
    num_batches = _num_batches(train_rows, samples, batch_size)
    names = [f.name for f in schema.sparse]
    kept: dict[str, list[np.ndarray]] = {n: [] for n in names}
    kept_count = dict.fromkeys(names, 0)
    lookups = dict.fromkeys(names, 0)
    distinct: dict[str, list[int]] = {n: [] for n in names}
    # The kept ids in 4 bytes where the table's ids fit (half the memory of a sample).
    dtypes = {f.name: np.int32 if f.num_embeddings <= 2**31 else np.int64 for f in schema.sparse}
    seen = 0
    batches: Iterator[Batch] = source.train_batches(batch_size)
    bar = tqdm(total=num_batches, desc="profile", unit="batch", disable=not progress, leave=False)
    try:
        for _ in range(num_batches):
            batch = next(batches)
            rows = len(batch.labels)
            if train_rows is not None:  # the epoch's last batch wraps into the next epoch
                rows = min(rows, train_rows - seen)
            by_key = batch.sparse.to_dict()
            for name in names:
                jagged = by_key[name]
                lengths = jagged.lengths.numpy()[:rows]
                ids = jagged.values.numpy()[: int(lengths.sum())]
                lookups[name] += len(ids)
                distinct[name].append(len(np.unique(ids)))
                if kept_count[name] < max_ids:
                    take = ids[: max_ids - kept_count[name]].astype(dtypes[name], copy=True)
                    kept[name].append(take)
                    kept_count[name] += len(take)
            seen += rows
            bar.update(1)
            if min(kept_count.values()) >= max_ids:
                break  # every table has its sample; the rest would only refine the means
    finally:
        bar.close()
    total = train_rows if train_rows is not None else samples
    assert total is not None
    tables = []
    for f in tqdm(schema.sparse, desc="stack distances", disable=not progress, leave=False):
        stream = np.concatenate(kept[f.name]) if kept[f.name] else np.zeros(0, np.int64)
        tables.append(
            summarize(
                f.name,
                f.num_embeddings,
                stream,
                batch_size=batch_size,
                pooling_factor=lookups[f.name] / max(seen, 1),
                distinct_per_batch=np.array(distinct[f.name], dtype=np.float64),
                # The stream's ids: counted, or (stopped early) extrapolated from the mean.
                total_lookups=round(lookups[f.name] * total / max(seen, 1)),
            )
        )
    return LocalityProfile(
        source=description,
        batch_size=batch_size,
        samples_profiled=seen,
        samples_total=total,
        max_ids=max_ids,
        tables=tuple(tables),
    )


# ------------------------------------------------------------------ views
def _rows(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def report_table(profile: LocalityProfile) -> str:
    """Per table: size, sample, distinct ids per batch, cold misses, the hit rate at each
    cache share, the rows each hit-rate target needs; then the distance histograms."""
    shares = [f"{f:g}" for f in CACHE_FRACTIONS]
    targets = [f"{t:g}" for t in HIT_TARGETS]
    head = (
        f"{'table':<14} {'rows':>11} {'ids':>10} {'distinct/batch mean p50 p99':>29} "
        f"{'cold':>6} "
        + " ".join(f"{float(s) * 100:>5g}%" for s in shares)
        + "  "
        + " ".join(f"{'rows@' + format(float(t) * 100, 'g') + '%':>11}" for t in targets)
    )
    lines = [
        f"locality of {profile.source or 'the data'}: batch size {profile.batch_size}, "
        f"{profile.samples_profiled:,} samples read",
        "hit rate of an LRU cache holding a share of the table's rows; rows@X%: the cache "
        "that hits X% (- : cold misses alone exceed 1 - X)",
        head,
    ]
    sampled = []
    for t in profile.tables:
        d = t.distinct_per_batch
        cold = t.cold_misses / max(t.lookups, 1)
        lines.append(
            f"{t.name[:14]:<14} {t.num_embeddings:>11,} {t.lookups:>10,} "
            f"{d['mean']:>11.1f} {d['p50']:>8.0f} {d['p99']:>8.0f} {cold:>6.1%} "
            + " ".join(f"{t.hit_rate_at[s]:>6.1%}" for s in shares)
            + "  "
            + " ".join(f"{_rows(t.rows_for[k]):>11}" for k in targets)
        )
        if t.sampled:
            sampled.append(f"{t.name} ({t.lookups:,} of {t.total_lookups:,} ids)")
    if sampled:
        lines.append(
            f"sampled (the first --max-ids {profile.max_ids:,} ids of the stream; cold misses "
            "weigh more in a prefix than over the whole run): " + ", ".join(sampled)
        )
    lines.append("reuse distances (share of lookups; cold, then log2 buckets [1,2) [2,4) ...):")
    for t in profile.tables:
        n = max(t.lookups, 1)
        cells = [f"cold {t.cold_misses / n:.1%}"] + [
            f"2^{k} {c / n:.1%}" for k, c in enumerate(t.histogram) if c
        ]
        lines.append(f"  {t.name}: " + ", ".join(cells))
    return "\n".join(lines)


def write_plot(profile: LocalityProfile, path: str | Path) -> None:
    """PNG: hit rate against cache size (share of rows, log scale) per table, and each
    table's reuse-distance histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    for t in profile.tables:
        if not t.curve:
            continue
        share = [r / t.num_embeddings for r, _ in t.curve]
        ax_hit.plot(share, [h for _, h in t.curve], label=t.name, linewidth=1.2)
        n = max(t.lookups, 1)
        ax_hist.plot(
            range(-1, len(t.histogram)),
            [t.cold_misses / n] + [c / n for c in t.histogram],
            marker=".",
            linewidth=1,
            label=t.name,
        )
    ax_hit.set_xscale("log")
    ax_hit.set_xlabel("LRU cache size (share of the table's rows)")
    ax_hit.set_ylabel("predicted hit rate")
    ax_hit.set_ylim(0, 1)
    ax_hit.grid(True, which="both", alpha=0.3)
    ax_hist.set_xlabel("stack distance bucket k: [2^k, 2^(k+1)) rows (-1: cold)")
    ax_hist.set_ylabel("share of lookups")
    ax_hist.grid(True, alpha=0.3)
    _, labels = ax_hit.get_legend_handles_labels()
    if len(labels) <= 30:
        ax_hit.legend(fontsize=7, ncol=2 if len(labels) > 10 else 1)
    fig.suptitle(f"locality of {profile.source or 'the data'}, batch {profile.batch_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
