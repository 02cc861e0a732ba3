import numpy as np
import pytest
import torch

from towerrec.data.synthetic import BLOCK, SyntheticConfig, SyntheticSource
from towerrec.train.metrics import auc

SMALL = SyntheticConfig(
    num_embeddings=(50, 20, 300), pooling_factors=(1, 3, 1), num_dense=4, eval_samples=5000
)


def same_batch(a, b):
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
    )


def test_deterministic_by_seed_and_independent_of_chunking():
    src, again = SyntheticSource(SMALL), SyntheticSource(SMALL)
    whole, _ = src.samples("train", 100, 2 * BLOCK)
    assert same_batch(whole, again.samples("train", 100, 2 * BLOCK)[0])
    # The same samples cut at other boundaries (across a block edge).
    part, _ = src.samples("train", 100 + BLOCK - 10, 30)
    cut = whole.sparse.offsets()
    assert torch.equal(part.dense, whole.dense[BLOCK - 10 : BLOCK + 20])
    assert torch.equal(part.labels, whole.labels[BLOCK - 10 : BLOCK + 20])
    assert torch.equal(
        part.sparse["cat_1"].lengths, whole.sparse["cat_1"].lengths[BLOCK - 10 : BLOCK + 20]
    )
    assert cut.numel() > 0
    other = SyntheticSource(SyntheticConfig(**{**SMALL.__dict__, "seed": 1}))
    assert not torch.equal(
        other.samples("train", 0, 100)[0].dense, src.samples("train", 0, 100)[0].dense
    )


def test_rank_slices_tile_the_global_batch():
    src = SyntheticSource(SMALL)
    single = next(src.train_batches(64, start_batch=3))
    parts = [next(src.train_batches(16, start_batch=3, rank=r, world_size=4)) for r in range(4)]
    assert torch.equal(torch.cat([p.dense for p in parts]), single.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), single.labels)


def test_resume_position_continues_the_stream():
    src = SyntheticSource(SMALL)
    stream = src.train_batches(32)
    batches = [next(stream) for _ in range(5)]
    assert same_batch(next(src.train_batches(32, start_batch=3)), batches[3])


def test_ids_lengths_and_skew():
    src = SyntheticSource(SMALL)
    batch, probs = src.samples("train", 0, 20000)
    jag = batch.sparse
    assert jag.keys() == ["cat_0", "cat_1", "cat_2"]
    assert (jag["cat_0"].lengths == 1).all()
    lengths = jag["cat_1"].lengths.float()
    assert (lengths >= 1).all() and abs(lengths.mean().item() - 3) < 0.1
    ids = jag["cat_2"].values
    assert ids.min() >= 0 and ids.max() < 300
    counts = torch.bincount(ids, minlength=300).sort(descending=True).values
    assert counts[:3].sum() > 0.15 * counts.sum()  # Zipf: a few hot ids carry much of the traffic
    assert probs.min() > 0 and probs.max() < 1


def test_oracle_auc_is_high_and_labels_follow_teacher():
    src = SyntheticSource(SMALL)
    labels, probs = src.eval_oracle()
    assert labels.shape == (5000,)
    oracle = auc(probs, labels)
    assert 0.7 < oracle < 0.95
    assert abs(labels.mean() - SMALL.ctr) < 0.03
    # A shuffled teacher scores no better than chance: the labels carry its signal.
    assert abs(auc(np.random.default_rng(0).permutation(probs), labels) - 0.5) < 0.03


def test_teacher_scores_follow_their_definitions():
    """Each order's raw score against its definition over the teacher's field vectors
    (the dense projection and the tables' rows, pooled bags averaged): the first order
    the dense weights plus the rows' biases, the pairwise sum_ij C_ij <f_i, f_j> through
    the Gram matrices, the higher order the triples' products."""
    src = SyntheticSource(SMALL)
    teacher = src._teacher
    dense, sparse, orders, fields = src._raw_block("train", 2, with_fields=True)
    assert fields.shape == (BLOCK, 4, SMALL.teacher_dim)
    np.testing.assert_allclose(fields[:, 0], dense.astype(np.float64) @ teacher.dense_proj)
    first = dense.astype(np.float64) @ teacher.dense_weight
    for t, (lengths, ids) in enumerate(sparse):
        owner = np.repeat(np.arange(BLOCK), lengths)
        pooled = np.zeros((BLOCK, SMALL.teacher_dim))
        np.add.at(pooled, owner, teacher.embeddings[t][ids])
        np.testing.assert_allclose(fields[:, t + 1], pooled / SMALL.pooling(t), rtol=1e-12)
        first += np.bincount(owner, teacher.biases[t][ids], minlength=BLOCK) / SMALL.pooling(t)
    gram = np.einsum("bik,bjk->bij", fields, fields)
    pairwise = np.einsum("bij,ij->b", gram, teacher.pair_coef)
    higher = sum(
        c * (fields[:, i] * fields[:, j] * fields[:, m]).sum(1)
        for (i, j, m), c in zip(teacher.triples, teacher.triple_coef)
    )
    np.testing.assert_allclose(orders[:, 0], first, rtol=1e-12)
    np.testing.assert_allclose(orders[:, 1], pairwise, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(orders[:, 2], higher, rtol=1e-10, atol=1e-12)
    assert np.abs(orders[:, 1]).max() > 0.1  # every order carries signal here


def test_eval_split_is_disjoint_from_train_and_rank_split():
    src = SyntheticSource(SMALL)
    train, _ = src.samples("train", 0, 100)
    evals = list(src.eval_batches(1000))
    assert sum(b.size for b in evals) == 5000
    assert not torch.equal(evals[0].dense[:100], train.dense)
    halves = [next(iter(src.eval_batches(10_000, rank=r, world_size=2))) for r in range(2)]
    assert torch.equal(torch.cat([h.dense for h in halves]), torch.cat([b.dense for b in evals]))


def test_stream_seed_redraws_training_samples_only():
    src = SyntheticSource(SMALL)
    other = SyntheticSource(SyntheticConfig(**{**SMALL.__dict__, "stream_seed": 3}))
    train, probs = src.samples("train", 0, 500)
    train3, probs3 = other.samples("train", 0, 500)
    assert not torch.equal(train.dense, train3.dense) and not np.array_equal(probs, probs3)
    assert same_batch(src.samples("eval", 0, 500)[0], other.samples("eval", 0, 500)[0])
    # the same teacher: equal oracle on the shared eval set
    assert np.array_equal(src.eval_oracle()[0], other.eval_oracle()[0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stream_seed": -1}, "stream_seed must be >= 0"),
        ({"num_embeddings": ()}, "at least one table size"),
        ({"num_embeddings": (10, 0)}, "must all be >= 1"),
        ({"num_embeddings": (5, 6, 7), "pooling_factors": (1, 2)}, "give one per table"),
        ({"ctr": 1.5}, r"ctr must lie in \(0, 1\)"),
        ({"higher_order_share": 0.1, "num_triples": 0}, "needs num_triples >= 1"),
        ({"first_order_share": -1}, "positive sum"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**kwargs)


@pytest.mark.multiprocess
def test_a_process_forked_after_torchs_threads_ran_draws_the_same_blocks():
    """The data is drawn in numpy alone: a process forked after torch's OpenMP threads
    ran (a service or a worker started with fork) draws blocks, where a parallel torch
    operator would wait forever on threads the fork did not copy; and the same ones."""
    import multiprocessing

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        (x @ x).sum()  # a parallel region in this process
        src = SyntheticSource(SMALL)
        want = src._make_block("train", 1)[2]
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()

        def draw():
            queue.put(SyntheticSource(SMALL)._make_block("train", 1)[2])

        child = ctx.Process(target=draw, daemon=True)
        child.start()
        try:
            got = queue.get(timeout=60)
            child.join(60)
        finally:
            if child.is_alive():
                child.kill()
    finally:
        torch.set_num_threads(threads)
    assert child.exitcode == 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [1, 3, 50, 1000, 20000])
def test_the_rank_grid_gives_the_searchs_ranks(rows):
    """_ranks against np.searchsorted on Zipf CDFs, with draws at the edges: 0, the CDF's
    own entries and their neighbours, the grid's bucket boundaries, the last double
    below 1, and uniform draws."""
    from towerrec.data.synthetic import _rank_grid, _ranks

    weights = 1.0 / np.arange(1, rows + 1) ** 1.1
    cdf = np.cumsum(weights) / weights.sum()
    grid = _rank_grid(cdf)
    buckets = len(grid) - 1
    edges = np.concatenate(
        [
            [0.0, np.nextafter(1.0, 0.0)],
            cdf[cdf < 1],
            np.nextafter(cdf[cdf < 1], 0.0),
            np.nextafter(cdf[cdf < 1], 1.0),
            np.arange(buckets) / buckets,
            np.nextafter(np.arange(1, buckets) / buckets, 0.0),
            np.random.default_rng(rows).random(50_000),
        ]
    )
    edges = edges[(edges >= 0) & (edges < 1)]
    np.testing.assert_array_equal(_ranks(cdf, grid, edges), np.searchsorted(cdf, edges))
