"""Synthetic click data with a planted truth: the embedded default data set.

A hidden random *teacher* draws every label, so the best achievable AUC is
known: the teacher's own click probabilities scored against the labels it drew
(the oracle AUC). For sample n::

    x      ~ N(0, I)                          dense features [F]
    ids_t  ~ Zipf(alpha) over a random permutation of table t's rows
             (pooling factor p_t > 1: 1 + Poisson(p_t - 1) ids)
    e_0    = x P                              dense features seen as one more field
    e_t    = sum_i V_t[ids_t,i] / p_t         teacher embeddings V_t [rows_t, k]
    z1     = sum_t sum_i b_t[ids_t,i] / p_t + w.x           first order
    z2     = sum_{i<j} C_ij <e_i, e_j>                      pairwise
    z3     = sum_{(i,j,l)} c_ijl sum_k e_ik e_jk e_lk       higher order (3-way)
    z      = a (sqrt(s1) z1/|z1| + sqrt(s2) z2/|z2| + sqrt(s3) z3/|z3|) + c
    label  ~ Bernoulli(sigmoid(z))

Each order's share s of the logit variance is set by the config (|z| is its
standard deviation on a pilot sample), so how hard the data is does not hinge
on the random draw of the teacher; ``a`` sets the logit's spread and ``c`` the
click rate, both fitted on the pilot sample. Samples are generated in
fixed blocks, each from its own generator seeded by (seed, split, block): the
stream is the same whatever the batch size, world size or resume point, and
nothing beyond two blocks is held in memory.

Periods (``towerrec replay``; ``periods`` >= 2): the training stream is cut into
``periods`` slices of ``period_samples`` samples, period p holding stream samples
``[p*S, (p+1)*S)``, each labelled by the teacher of its period::

    teacher_p  = sqrt(1 - drift) teacher_{p-1} + sqrt(drift) fresh_p      drift_mode "random"
    teacher_p  = cos(p phi) teacher_0 + sin(p phi) direction               drift_mode "trend"
                 (embeddings, biases, dense weights; the pair and triple
                 structure and the pilot-fitted scale and shift stay)
    active ids each table uses A = floor(rows / (1 + (periods - 1) id_turnover))
                 of its rows; per period floor(id_turnover A) Zipf ranks, drawn
                 at random, retire their id for one never used before

"random" moves towards a fresh random teacher each period (a random walk: nothing
to forecast). "trend" turns the teacher at a constant rate along one fixed random
``direction`` (drawn once, scaled as the teacher), ``cos(phi) = sqrt(1 - drift)``: the
same correlation between consecutive teachers as "random", but the change persists
from period to period, so the next period is predictable from the last ones.
drift = 0 and id_turnover = 0 give every period the same teacher and the same
samples as the stationary stream (periods 0 or 1: that stream, bit for bit). The
oracle AUC of a period is its own teacher's probabilities scored on its labels.
The eval split is always period 0's teacher.

Domains (``domains`` K >= 2; docs/exfm.md): a family of K streams whose teachers share a
part and differ in the rest. The stream of domain d (``domain``) is labelled by::

    teacher_{p,d} = sqrt(shared) teacher_p + sqrt(1 - shared) own_d
                    (embeddings, biases, dense weights; own_d drawn once per domain,
                    the pair and triple structure and the scale and shift shared)

draws its own samples (ids from the same active rows), and carries one more sparse
feature, ``domain`` (K rows, id d), so a model trained on the union of the domains'
streams can tell them apart. ``domains = 1`` (the default): the stream above, bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch

from towerrec.data.batch import Batch, DataSchema, SparseFeature
from towerrec.data.periods import period_rank_batches
from towerrec.sparse import KeyedJaggedTensor
from towerrec.utils import at_least, within

__all__ = ["SyntheticConfig", "SyntheticSource"]

BLOCK = 4096
_SPLITS = {"train": 0, "eval": 1, "pilot": 2}


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic data and of its hidden teacher."""

    num_dense: int = 13
    num_embeddings: tuple[int, ...] = (300, 100, 1000, 50, 500, 200, 100, 200, 500)
    pooling_factors: tuple[float, ...] = (1, 1, 1, 1, 1, 1, 1, 1, 3)  # per table; () = single-hot
    zipf_alpha: float = 1.1
    teacher_dim: int = 4
    num_triples: int = 4
    first_order_share: float = 0.10
    pairwise_share: float = 0.88
    higher_order_share: float = 0.02
    logit_std: float = 1.6
    ctr: float = 0.3
    eval_samples: int = 100_000
    seed: int = 0
    stream_seed: int = 0  # another draw of training samples from the same teacher and eval set
    feature_prefix: str = "cat_"
    periods: int = 0  # time slices for `towerrec replay`; 0 or 1: one stationary stream
    period_samples: int = 20_000  # training samples per period
    drift: float = 0.0  # how far the teacher moves towards a fresh one per period, [0, 1]
    drift_mode: str = "random"  # random: towards a fresh teacher; trend: along one direction
    id_turnover: float = 0.0  # share of each table's active ids replaced per period, [0, 1)
    domains: int = 1  # streams of one family (docs/exfm.md); 1: the single stream
    domain: int = 0  # which of the family's streams this one is, [0, domains)
    domain_shared: float = 0.5  # share of the teacher's variance the domains have in common

    def __post_init__(self) -> None:
        at_least("data.synthetic.num_dense", self.num_dense, 0)
        if not self.num_embeddings:
            raise ValueError("data.synthetic.num_embeddings needs at least one table size")
        if any(n < 1 for n in self.num_embeddings):
            raise ValueError(
                f"data.synthetic.num_embeddings must all be >= 1, got {list(self.num_embeddings)}"
            )
        if self.pooling_factors and len(self.pooling_factors) != len(self.num_embeddings):
            raise ValueError(
                f"data.synthetic.pooling_factors has {len(self.pooling_factors)} entries for "
                f"{len(self.num_embeddings)} tables; give one per table (1 = single-hot), or "
                "pooling_factors = [] for all single-hot"
            )
        if any(p < 1 for p in self.pooling_factors):
            raise ValueError("data.synthetic.pooling_factors must be >= 1 (1 = single-hot)")
        if self.zipf_alpha < 0:
            raise ValueError("data.synthetic.zipf_alpha must be >= 0 (0 = uniform ids)")
        shares = (self.first_order_share, self.pairwise_share, self.higher_order_share)
        if min(shares) < 0 or sum(shares) <= 0:
            raise ValueError(
                "data.synthetic first_order_share, pairwise_share and higher_order_share must be "
                f">= 0 with a positive sum, got {shares}"
            )
        if self.higher_order_share > 0 and self.num_triples == 0:
            raise ValueError("data.synthetic.higher_order_share > 0 needs num_triples >= 1")
        if self.num_triples < 0:
            raise ValueError("data.synthetic.num_triples must be >= 0")
        at_least("data.synthetic.stream_seed", self.stream_seed, 0)
        if self.teacher_dim < 1 or self.eval_samples < 1:
            raise ValueError("data.synthetic.teacher_dim and eval_samples must be >= 1")
        within("data.synthetic.ctr", self.ctr, "(0, 1)")
        object.__setattr__(self, "num_embeddings", tuple(self.num_embeddings))
        object.__setattr__(self, "pooling_factors", tuple(float(p) for p in self.pooling_factors))
        self._check_periods()
        if self.domains < 1 or not 0 <= self.domain < self.domains:
            raise ValueError(
                f"data.synthetic.domain = {self.domain} must lie in [0, data.synthetic.domains "
                f"= {self.domains}) and domains must be >= 1"
            )
        if not 0 <= self.domain_shared <= 1:
            raise ValueError(
                f"data.synthetic.domain_shared = {self.domain_shared} must lie in [0, 1] (1: "
                "every domain has the same teacher, 0: unrelated teachers)"
            )

    def _check_periods(self) -> None:
        key = "data.synthetic"
        at_least(f"{key}.periods", self.periods, 0, hint="0 or 1: one stationary stream")
        at_least(f"{key}.period_samples", self.period_samples, 1)
        within(
            f"{key}.drift",
            self.drift,
            "[0, 1]",
            hint="0: the same teacher every period, 1: a fresh one",
        )
        if self.drift_mode not in ("random", "trend"):
            raise ValueError(
                f"data.synthetic.drift_mode = {self.drift_mode!r} is not one of 'random' (the "
                "teacher moves towards a fresh random one each period) or 'trend' (it turns "
                "along one fixed direction)"
            )
        within(
            f"{key}.id_turnover",
            self.id_turnover,
            "[0, 1)",
            hint="the share of active ids replaced per period",
        )
        if self.periods <= 1 and (self.drift or self.id_turnover):
            warnings.warn(
                "data.synthetic.drift and id_turnover act between periods and are ignored with "
                f"periods = {self.periods}; set data.synthetic.periods >= 2",
                stacklevel=3,
            )
        if self.active_ids(min(self.num_embeddings, default=1)) < 1:
            raise ValueError(
                f"data.synthetic.id_turnover = {self.id_turnover} over {self.periods} periods "
                f"needs tables of at least {1 + (self.periods - 1) * self.id_turnover:.0f} rows "
                "(each period's new ids are rows no earlier period used); lower id_turnover or "
                "periods, or raise num_embeddings"
            )

    @property
    def num_periods(self) -> int:
        return max(self.periods, 1)

    def active_ids(self, rows: int) -> int:
        """How many of a table's ``rows`` ids one period uses (all without turnover)."""
        if self.num_periods == 1 or self.id_turnover == 0:
            return rows
        return int(rows / (1 + (self.num_periods - 1) * self.id_turnover))

    @property
    def num_tables(self) -> int:
        return len(self.num_embeddings)

    def pooling(self, table: int) -> float:
        return self.pooling_factors[table] if self.pooling_factors else 1.0


@dataclass
class _Teacher:
    dense_proj: np.ndarray  # [F, k]
    dense_weight: np.ndarray  # [F]
    embeddings: list[np.ndarray]  # per table [rows, k]
    biases: list[np.ndarray]  # per table [rows]
    pair_coef: np.ndarray  # [T+1, T+1], strictly upper triangular
    triples: np.ndarray  # [n, 3] field indices
    triple_coef: np.ndarray  # [n]
    cdfs: list[np.ndarray] = field(default_factory=list)  # Zipf CDF per table
    grids: list[np.ndarray] = field(default_factory=list)  # per table: _rank_grid(cdf)
    perms: list[np.ndarray] = field(default_factory=list)  # rank -> id per table (active ids)
    unused: list[np.ndarray] = field(default_factory=list)  # ids no period has used yet, per table
    weights: np.ndarray = field(default_factory=lambda: np.ones(3))  # per order, pilot-fitted
    shift: float = 0.0


# Buckets of a rank grid (a power of two: a draw times it is exact): at most this many,
# and up to 16 a rank of the table's CDF.
GRID_BUCKETS = 1 << 16


def _rank_grid(cdf: np.ndarray) -> np.ndarray:
    """``grid[k]``: the CDF's entries below ``k / G`` (G buckets, ``_ranks``)."""
    buckets = min(GRID_BUCKETS, 1 << max(4, int(np.ceil(np.log2(16 * len(cdf))))))
    return np.searchsorted(cdf, np.arange(buckets + 1) / buckets)


def _ranks(cdf: np.ndarray, grid: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """``np.searchsorted(cdf, draws)`` for draws in [0, 1), the same ranks, 2.8x faster
    over the default tables' draws (6.6x over the 3-id table's): a draw in bucket k
    (``draws * G`` is exact) has between ``grid[k]`` and ``grid[k + 1]`` entries below
    it; where the two agree that is its rank, elsewhere (a bucket an entry falls in) the
    search decides."""
    bucket = (draws * (len(grid) - 1)).astype(np.int64)
    ranks = grid[bucket]
    open_ = np.flatnonzero(grid[bucket + 1] != ranks)
    ranks[open_] = np.searchsorted(cdf, draws[open_])
    return ranks


class SyntheticSource:
    """Streams batches of the planted-truth data (see module docstring)."""

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        cfg = self.config
        self.schema = DataSchema(
            num_dense=cfg.num_dense,
            sparse=tuple(
                SparseFeature(f"{cfg.feature_prefix}{t}", rows, cfg.pooling(t))
                for t, rows in enumerate(cfg.num_embeddings)
            )
            + ((SparseFeature("domain", cfg.domains, 1.0),) if cfg.domains > 1 else ()),
        )
        self._teacher = self._build_teacher()
        self._teachers = [self._teacher]  # per period, drawn on demand
        self._direction: _Teacher | None = None  # drift_mode "trend"'s, drawn on demand
        self._own = self._domain_part() if cfg.domains > 1 else None
        self._domain_teachers: dict[int, _Teacher] = {}
        self._block_cache = lru_cache(maxsize=4)(self._make_block)

    # -------------------------------------------------------------- teacher
    def _build_teacher(self) -> _Teacher:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 99])
        k, num_fields = cfg.teacher_dim, cfg.num_tables + 1
        teacher = _Teacher(
            dense_proj=rng.normal(size=(cfg.num_dense, k)) / np.sqrt(max(cfg.num_dense, 1)),
            dense_weight=rng.normal(size=cfg.num_dense) / np.sqrt(max(cfg.num_dense, 1)),
            embeddings=[rng.normal(size=(n, k)) for n in cfg.num_embeddings],
            biases=[rng.normal(size=n) for n in cfg.num_embeddings],
            pair_coef=np.triu(rng.normal(size=(num_fields, num_fields)), 1) / np.sqrt(num_fields),
            triples=np.array(
                [rng.choice(num_fields, size=3, replace=False) for _ in range(cfg.num_triples)],
                dtype=np.int64,
            ).reshape(-1, 3),
            triple_coef=rng.normal(size=cfg.num_triples),
        )
        for rows in cfg.num_embeddings:
            active = cfg.active_ids(rows)
            weights = 1.0 / np.arange(1, active + 1, dtype=np.float64) ** cfg.zipf_alpha
            cdf = np.cumsum(weights)
            teacher.cdfs.append(cdf / cdf[-1])
            teacher.grids.append(_rank_grid(teacher.cdfs[-1]))
            ids = rng.permutation(rows)
            teacher.perms.append(ids[:active])
            teacher.unused.append(ids[active:])
        # Fit scale and shift on a pilot sample: logit spread and click rate.
        self._teacher = teacher
        orders = self._raw_block("pilot", 0)[-1]  # [BLOCK, 3]
        shares = np.array([cfg.first_order_share, cfg.pairwise_share, cfg.higher_order_share])
        std = orders.std(axis=0)
        weights = np.where(std > 0, np.sqrt(shares / shares.sum()) / np.where(std > 0, std, 1), 0)
        mixed = orders @ weights
        teacher.weights = weights * cfg.logit_std / mixed.std()
        teacher.shift = _shift_for_ctr(orders @ teacher.weights, cfg.ctr)
        return teacher

    def _period_teacher(self, period: int) -> _Teacher:
        """The teacher of training period ``period`` (module docstring)."""
        if not 0 <= period < self.config.num_periods:
            raise ValueError(
                f"period {period} is not in [0, data.synthetic.periods = {self.config.num_periods})"
            )
        while len(self._teachers) <= period:
            self._teachers.append(self._next_teacher(self._teachers[-1], len(self._teachers)))
        return self._teachers[period]

    def _domain_part(self) -> _Teacher:
        """Domain ``domain``'s own part of its teacher (module docstring)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 97, cfg.domain])
        dense_scale = 1 / np.sqrt(max(cfg.num_dense, 1))
        return replace(
            self._teacher,
            dense_proj=rng.normal(size=self._teacher.dense_proj.shape) * dense_scale,
            dense_weight=rng.normal(size=self._teacher.dense_weight.shape) * dense_scale,
            embeddings=[rng.normal(size=e.shape) for e in self._teacher.embeddings],
            biases=[rng.normal(size=b.shape) for b in self._teacher.biases],
        )

    def _stream_teacher(self, period: int) -> _Teacher:
        """The teacher that labels this stream's ``period``: the period's, mixed with the
        domain's own part when there are several domains."""
        shared = self._period_teacher(period)
        own = self._own
        if own is None:
            return shared
        if period not in self._domain_teachers:
            a, b = np.sqrt(self.config.domain_shared), np.sqrt(1 - self.config.domain_shared)
            self._domain_teachers[period] = replace(
                shared,
                dense_proj=a * shared.dense_proj + b * own.dense_proj,
                dense_weight=a * shared.dense_weight + b * own.dense_weight,
                embeddings=[a * s + b * o for s, o in zip(shared.embeddings, own.embeddings)],
                biases=[a * s + b * o for s, o in zip(shared.biases, own.biases)],
            )
        return self._domain_teachers[period]

    def _next_teacher(self, previous: _Teacher, period: int) -> _Teacher:
        """Period ``period``'s teacher from the one before: drifted, ids turned over."""
        cfg = self.config
        if cfg.drift == 0 and cfg.id_turnover == 0:
            return previous
        rng = np.random.default_rng([cfg.seed, 98, period])
        keep, move = np.sqrt(1 - cfg.drift), np.sqrt(cfg.drift)

        def drifted(values: np.ndarray, scale: float = 1.0) -> np.ndarray:
            if cfg.drift == 0:
                return values
            return keep * values + move * scale * rng.normal(size=values.shape)

        dense_scale = 1 / np.sqrt(max(cfg.num_dense, 1))
        perms, unused = [], []
        for perm, free in zip(previous.perms, previous.unused):
            count = int(cfg.id_turnover * len(perm))
            retired = rng.choice(len(perm), size=count, replace=False)
            perm = perm.copy()
            perm[retired] = free[:count]
            perms.append(perm)
            unused.append(free[count:])
        if cfg.drift_mode == "trend":
            start, direction = self._teacher, self._trend_direction()
            angle = period * np.arccos(keep)
            cos, sin = np.cos(angle), np.sin(angle)

            def turned(base: np.ndarray, toward: np.ndarray) -> np.ndarray:
                return base if cfg.drift == 0 else cos * base + sin * toward

            dense_proj = turned(start.dense_proj, direction.dense_proj)
            dense_weight = turned(start.dense_weight, direction.dense_weight)
            embeddings = [turned(e, d) for e, d in zip(start.embeddings, direction.embeddings)]
            biases = [turned(b, d) for b, d in zip(start.biases, direction.biases)]
        else:
            dense_proj = drifted(previous.dense_proj, dense_scale)
            dense_weight = drifted(previous.dense_weight, dense_scale)
            embeddings = [drifted(e) for e in previous.embeddings]
            biases = [drifted(b) for b in previous.biases]
        return replace(
            previous,
            dense_proj=dense_proj,
            dense_weight=dense_weight,
            embeddings=embeddings,
            biases=biases,
            perms=perms,
            unused=unused,
        )

    def _trend_direction(self) -> _Teacher:
        """The fixed direction a "trend" drift turns the teacher towards, scaled as it."""
        if self._direction is None:
            cfg, start = self.config, self._teacher
            rng = np.random.default_rng([cfg.seed, 96])
            dense_scale = 1 / np.sqrt(max(cfg.num_dense, 1))
            self._direction = replace(
                start,
                dense_proj=rng.normal(size=start.dense_proj.shape) * dense_scale,
                dense_weight=rng.normal(size=start.dense_weight.shape) * dense_scale,
                embeddings=[rng.normal(size=e.shape) for e in start.embeddings],
                biases=[rng.normal(size=b.shape) for b in start.biases],
            )
        return self._direction

    def _block_seed(self, split: str, block: int) -> list[int]:
        """Seed of a block's generator; ``stream_seed`` changes only the training samples."""
        seed = [self.config.seed, _SPLITS[split], block]
        if split == "train" and self.config.stream_seed:
            seed.append(1000 + self.config.stream_seed)
        if self.config.domains > 1 and split != "pilot":  # each domain its own samples
            seed.append(3000 + self.config.domain)
        return seed

    def _raw_block(
        self, split: str, block: int, *, with_fields: bool = False, teacher: _Teacher | None = None
    ):
        """One block: dense, per-table (lengths, ids), and the teacher's raw score
        ``[BLOCK, 3]`` of each order (first, pairwise, higher); with ``with_fields``
        also the teacher's field vectors ``[BLOCK, T+1, k]``. ``teacher``: period 0's
        unless given."""
        cfg = self.config
        teacher = self._teacher if teacher is None else teacher
        rng = np.random.default_rng(self._block_seed(split, block))
        dense = rng.standard_normal((BLOCK, cfg.num_dense), dtype=np.float32)
        # the field vectors field-major, [T+1, BLOCK, k]: each field's rows written whole
        fields = np.empty((cfg.num_tables + 1, BLOCK, cfg.teacher_dim))
        fields[0] = dense @ teacher.dense_proj
        first = dense @ teacher.dense_weight
        sparse = []
        for t in range(cfg.num_tables):
            pooling = cfg.pooling(t)
            if pooling > 1:
                lengths = 1 + rng.poisson(pooling - 1, size=BLOCK)
            else:
                lengths = np.ones(BLOCK, dtype=np.int64)
            ranks = _ranks(teacher.cdfs[t], teacher.grids[t], rng.random(int(lengths.sum())))
            ids = teacher.perms[t][np.minimum(ranks, len(teacher.perms[t]) - 1)]
            sparse.append((lengths.astype(np.int64), ids.astype(np.int64)))
            if pooling > 1:
                owner = np.repeat(np.arange(BLOCK), lengths)
                rows = teacher.embeddings[t][ids]
                for c in range(rows.shape[1]):  # each bag's rows added in order (np.add.at's)
                    fields[t + 1, :, c] = np.bincount(owner, rows[:, c], minlength=BLOCK)
                fields[t + 1] /= pooling
                bias = np.bincount(owner, teacher.biases[t][ids], minlength=BLOCK) / pooling
            else:
                np.take(teacher.embeddings[t], ids, axis=0, out=fields[t + 1])
                bias = teacher.biases[t][ids]
            first = first + bias
        # sum_ij C_ij <f_i, f_j>, C strictly upper triangular: each field against the
        # weighted sum of the fields after it, F [T+1, BLOCK k] (11x faster than the Gram
        # matrices' einsum on the default data). Numpy's einsum, not BLAS: a product of
        # this size would start OpenBLAS's threads, which spin beside the training step's
        # (2x slower steps on 2 cores); torch's operators would make the data depend on
        # torch's thread count, and hang in a process forked after torch's threads ran.
        flat = fields.reshape(cfg.num_tables + 1, -1)
        products = np.zeros(flat.shape[1])
        for i in range(cfg.num_tables):
            after = np.einsum("j,jn->n", teacher.pair_coef[i, i + 1 :], flat[i + 1 :])
            products += flat[i] * after
        pairwise = products.reshape(BLOCK, -1).sum(1)
        higher = np.zeros(BLOCK)
        for (i, j, m), coef in zip(teacher.triples, teacher.triple_coef):
            higher += coef * np.einsum("bk,bk,bk->b", fields[i], fields[j], fields[m])
        orders = np.stack([first, pairwise, higher], axis=1)
        if with_fields:
            return dense, sparse, orders, fields.transpose(1, 0, 2)
        return dense, sparse, orders

    def _make_block(self, split: str, block: int, period: int = 0):
        teacher = self._stream_teacher(period)
        dense, sparse, orders = self._raw_block(split, block, teacher=teacher)
        logit = orders @ teacher.weights + teacher.shift
        prob = 1.0 / (1.0 + np.exp(-logit))
        rng = np.random.default_rng([*self._block_seed(split, block), 7])
        labels = (rng.random(BLOCK) < prob).astype(np.float32)
        return dense, sparse, labels, prob

    def planted_pair_strength(self) -> np.ndarray:
        """How much the teacher's logit uses each pair of categorical features, ``[T, T]``.

        Entry (i, j) is the standard deviation, over the pilot sample, of the
        pair's term ``C_ij <e_i, e_j>`` in the final logit (symmetric, zero
        diagonal). Reading it draws nothing from the data streams.
        """
        fields = self._raw_block("pilot", 0, with_fields=True)[3][:, 1:]  # drop the dense field
        coef = self._teacher.pair_coef[1:, 1:]
        terms = np.einsum("bik,bjk->bij", fields, fields) * (coef + coef.T)
        strength = terms.std(axis=0) * abs(self._teacher.weights[1])
        np.fill_diagonal(strength, 0.0)
        return strength

    # -------------------------------------------------------------- samples
    def samples(
        self, split: str, start: int, count: int, period: int = 0
    ) -> tuple[Batch, np.ndarray]:
        """Samples ``[start, start + count)`` of a split, and the teacher's probabilities;
        labelled by ``period``'s teacher (module docstring)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        first, last = start // BLOCK, (start + count - 1) // BLOCK
        blocks = [self._block_cache(split, b, period) for b in range(first, last + 1)]
        lo = start - first * BLOCK
        dense = np.concatenate([b[0] for b in blocks])[lo : lo + count]
        labels = np.concatenate([b[2] for b in blocks])[lo : lo + count]
        probs = np.concatenate([b[3] for b in blocks])[lo : lo + count]
        lengths_all, values_all = [], []
        for t in range(self.config.num_tables):
            lengths = np.concatenate([b[1][t][0] for b in blocks])
            ids = np.concatenate([b[1][t][1] for b in blocks])
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            lengths_all.append(lengths[lo : lo + count])
            values_all.append(ids[offsets[lo] : offsets[lo + count]])
        if self.config.domains > 1:  # the domain feature: one id, the stream's domain
            lengths_all.append(np.ones(count, dtype=np.int64))
            values_all.append(np.full(count, self.config.domain, dtype=np.int64))
        sparse = KeyedJaggedTensor(
            self.schema.sparse_names,
            torch.from_numpy(np.concatenate(values_all)),
            torch.from_numpy(np.concatenate(lengths_all)),
            validate=False,
        )
        batch = Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels), validate=False)
        return batch, probs

    def train_batches(
        self, batch_size: int, start_batch: int = 0, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        """Endless training stream: global batch i holds samples [i*G, (i+1)*G), G = B*world;
        rank r reads its contiguous B of them."""
        step = start_batch
        while True:
            start = step * batch_size * world_size + rank * batch_size
            yield self.samples("train", start, batch_size)[0]
            step += 1

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        lo, hi = _rank_range(self.config.eval_samples, rank, world_size)
        for start in range(lo, hi, batch_size):
            yield self.samples("eval", start, min(batch_size, hi - start))[0]

    @property
    def train_rows(self) -> None:
        """The training stream is endless: no row count."""
        return None

    @property
    def test_rows(self) -> int:
        """The stream's held-out split is its eval (validation) split; it has no test split."""
        return 0

    def test_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """No test split: no batches."""
        return iter(())

    def eval_oracle(self, rank: int = 0, world_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Labels and teacher probabilities of this rank's eval samples."""
        lo, hi = _rank_range(self.config.eval_samples, rank, world_size)
        batch, probs = self.samples("eval", lo, hi - lo)
        return batch.labels.numpy(), probs

    # -------------------------------------------------------------- periods
    @property
    def num_periods(self) -> int:
        return self.config.num_periods

    def period_rows(self, period: int) -> int:
        self._period_teacher(period)  # checks the period
        return self.config.period_samples

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        """This rank's batches of ``period``, in stream order (``periods.py``)."""
        start = period * self.period_rows(period)
        for lo, hi in period_rank_batches(self.config.period_samples, batch_size, rank, world_size):
            if hi > lo:
                yield self.samples("train", start + lo, hi - lo, period)[0]

    def period_oracle(self, period: int) -> tuple[np.ndarray, np.ndarray]:
        """Labels and the period's teacher probabilities of all its samples."""
        batch, probs = self.samples(
            "train", period * self.period_rows(period), self.config.period_samples, period
        )
        return batch.labels.numpy(), probs


def _rank_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank r's slice of ``total`` samples: together the ranks cover all of them."""
    return rank * total // world_size, (rank + 1) * total // world_size


def _shift_for_ctr(logits: np.ndarray, ctr: float) -> float:
    """The c for which mean(sigmoid(logits + c)) == ctr (bisection)."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(logits + mid)))) < ctr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
