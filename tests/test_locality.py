"""The locality profiler: exact LRU stack distances, the hit-rate curve, ``towerrec data
profile`` on a cache, and its errors."""

import itertools
import json
from collections import OrderedDict

import numpy as np
import pytest

from towerrec.cli import main
from towerrec.data.cache import SplitColumns
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.loader import ColumnSource, LoaderConfig
from towerrec.data.locality import (
    hit_curve,
    log2_histogram,
    rows_for_hit_rate,
    stack_distances,
    summarize,
)
from towerrec.data.profile import PROFILE_NAME, LocalityProfile, ProfileError, profile_source


def brute_force_distances(ids):
    """1 + distinct ids since the same id's last access; 0 for a first access."""
    last, out = {}, []
    for t, x in enumerate(ids):
        out.append(len(set(ids[last[x] + 1 : t])) + 1 if x in last else 0)
        last[x] = t
    return out


def lru_hits(ids, capacity):
    """Hits of a plain LRU cache of ``capacity`` rows."""
    cache, hits = OrderedDict(), 0
    for x in ids:
        if x in cache:
            hits += 1
            cache.move_to_end(x)
        else:
            cache[x] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_stack_distances_equal_a_brute_force_oracle(seed):
    rng = np.random.default_rng(seed)
    for n, alphabet in ((0, 1), (1, 1), (2, 2), (7, 3), (64, 5), (300, 40), (513, 1000)):
        ids = rng.integers(0, alphabet, n) * 7919 - 50  # any integers, negative ones too
        assert stack_distances(ids).tolist() == brute_force_distances(ids.tolist()), (n, alphabet)
    assert stack_distances(np.array([5, 6, 7, 6, 5, 5])).tolist() == [0, 0, 0, 2, 3, 1]


def test_hit_curve_equals_an_lru_simulation():
    rng = np.random.default_rng(1)
    ids = (rng.zipf(1.2, 6000) % 900).tolist()
    distances = stack_distances(np.array(ids))
    sizes = [1, 2, 5, 17, 64, 200, 899, 2000]
    curve = hit_curve(distances, np.array(sizes))
    for size, rate in zip(sizes, curve):
        assert rate * len(ids) == pytest.approx(lru_hits(ids, size), abs=1e-6), size
    cold = len(set(ids)) / len(ids)
    for target in (0.3, 0.5, (1 - cold) * 0.9, 1 - cold):
        rows = rows_for_hit_rate(distances, target)
        assert lru_hits(ids, rows) >= target * len(ids) - 1e-6 > lru_hits(ids, rows - 1)
    assert rows_for_hit_rate(distances, 1 - cold / 2) is None  # the cold misses forbid it
    # Histogram: every warm access in its log2 bucket, cold ones left out.
    hist = log2_histogram(distances)
    assert sum(hist) == len(ids) - len(set(ids))
    assert hist[0] == sum(1 for a, b in itertools.pairwise(ids) if a == b)


def test_summary_curve_interpolates_the_exact_rates():
    rng = np.random.default_rng(2)
    ids = rng.zipf(1.1, 20_000) % 5000
    t = summarize(
        "t",
        5000,
        ids,
        batch_size=100,
        pooling_factor=1.0,
        distinct_per_batch=np.array([80.0, 90.0]),
        total_lookups=40_000,
    )
    assert t.sampled and t.lookups == 20_000
    for rows, _ in t.curve[::7]:
        assert t.hit_rate(rows) == pytest.approx(lru_hits(ids.tolist(), rows) / len(ids))
    assert t.hit_rate(0) == 0.0
    assert t.hit_rate_at["0.01"] == pytest.approx(lru_hits(ids.tolist(), 50) / len(ids))
    again = type(t).from_dict(json.loads(json.dumps(t.as_dict())))
    assert again == t


def _store(rows, seed=0):
    """An in-memory store with a single-hot ``a`` and a multi-hot ``m`` feature."""
    from towerrec.data.batch import DataSchema, SparseFeature
    from towerrec.data.cache import ColumnStore

    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, rows).astype(np.int32)
    multi = (rng.integers(0, 30, int(lengths.sum())).astype(np.int32), lengths)
    part = SplitColumns.from_arrays(
        np.zeros(rows, np.float32),
        np.zeros((rows, 0), np.float32),
        rng.integers(0, 50, (rows, 1)).astype(np.int32),
        {"m": multi},
    )
    schema = DataSchema(0, (SparseFeature("a", 50), SparseFeature("m", 30, 1.5)))
    return ColumnStore(schema, ["a"], ["m"], {"train": [part]}), part


def test_profile_reads_one_epoch_in_training_order():
    store, part = _store(1000)
    source = ColumnSource(store, LoaderConfig(seed=3))
    profile = profile_source(source, batch_size=64, max_ids=1200)
    a, m = profile.tables
    assert profile.samples_profiled == 1000 and profile.samples_total == 1000
    # The stream is the loader's order: 16 batches, the last one the epoch's 40 left.
    stream = np.concatenate(
        [source.train_batch(i, 64).sparse.to_dict()["a"].values.numpy() for i in range(16)]
    )[:1000]
    assert a.total_lookups == a.lookups == 1000 and not a.sampled
    assert a.cold_misses == int((stack_distances(stream) == 0).sum())
    assert m.total_lookups == int(part.multi["m"][1][-1]) > 1200
    assert m.lookups == 1200 and m.sampled  # the first --max-ids of its stream
    assert m.pooling_factor == pytest.approx(m.total_lookups / 1000)
    distinct = [len(np.unique(stream[i * 64 : (i + 1) * 64])) for i in range(16)]
    assert a.distinct_per_batch["mean"] == pytest.approx(np.mean(distinct))
    assert a.distinct_per_batch["max"] == max(distinct)
    # Reading stops once every table has its sample; the epoch's ids are extrapolated.
    early = profile_source(source, batch_size=64, max_ids=100)
    assert early.samples_profiled == 128 and early.samples_total == 1000
    assert early.tables[0].total_lookups == 1000 and early.tables[0].lookups == 100


def test_a_changed_number_in_a_profile_is_refused(tmp_path):
    store, _ = _store(300)
    profile = profile_source(ColumnSource(store, LoaderConfig(seed=3)), batch_size=64)
    path = profile.save(tmp_path / "p.json")
    assert LocalityProfile.load(path) == profile  # unchanged: loads
    text = path.read_text()
    cold = profile.tables[0].cold_misses
    changed = text.replace(f'"cold_misses": {cold},', f'"cold_misses": {cold + 1},', 1)
    assert changed != text
    path.write_text(changed)
    with pytest.raises(ProfileError, match=r"p\.json does not match its own profile_sha256"):
        LocalityProfile.load(path)
    raw = json.loads(changed)
    del raw["profile_sha256"]  # a profile from before the digest: read as it is
    path.write_text(json.dumps(raw))
    assert LocalityProfile.load(path).tables[0].cold_misses == cold + 1


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    days = generate_criteo_files(root / "raw", files=1, rows_per_file=1500, seed=4)
    options = CriteoOptions(num_embeddings=(300,), eval_fraction=0.2)
    preprocess_criteo(days, root / "cache", options, progress=False)
    return root / "cache"


def test_cli_profiles_a_cache_into_it(tiny_cache, tmp_path, capsys):
    plot = tmp_path / "locality.png"
    code = main(
        ["data", "profile", str(tiny_cache), "--batch-size", "128", "--plot", str(plot),
         "--no-progress", "--json"]
    )  # fmt: skip
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["written"] == str(tiny_cache / PROFILE_NAME)
    profile = LocalityProfile.load(tiny_cache)  # the directory finds its profile
    assert len(profile.tables) == 26 and profile.batch_size == 128
    assert profile.samples_profiled == profile.samples_total == printed["samples_profiled"]
    assert all(t.lookups == profile.samples_total for t in profile.tables)  # single-hot
    assert plot.stat().st_size > 1000
    # The readable table, and the cache still opens with the profile beside it.
    assert main(["data", "profile", str(tiny_cache), "--out", str(tmp_path / "p.json"),
                 "--no-progress", "--max-ids", "100"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "rows@90%" in text and "sampled (the first --max-ids 100 ids" in text
    assert main(["data", "info", str(tiny_cache)]) == 0


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["data", "profile", str(tmp_path / "nowhere")]) == 2
    assert "neither a config file, a recipe (" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["data", "profile", str(empty)]) == 2
    assert "no manifest.json: it is not a finished cache" in capsys.readouterr().err
    (empty / "manifest.json").write_text("{not json")
    assert main(["data", "profile", str(empty)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"format": "towerrec-locality-profile", "version": 1, "tables": [{}]}')
    with pytest.raises(ProfileError, match="incomplete or garbled"):
        LocalityProfile.load(garbled)
    garbled.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="is not a locality profile"):
        LocalityProfile.load(garbled)


def test_the_benchmarks_fenwick_sweep_agrees():
    from towerrec.bench.locality import fenwick_stack_distances, run_locality_benchmark

    ids = np.random.default_rng(5).integers(0, 60, 800)
    assert fenwick_stack_distances(ids).tolist() == brute_force_distances(ids.tolist())
    result = run_locality_benchmark((500, 3000), rows=2000, reps=1, fenwick_ids=3000)
    assert result["fenwick_reference"]["equal"] is True
    assert [r["ids"] for r in result["stack_distances"]] == [500, 3000]


def test_cli_profiles_movielens_and_the_synthetic_stream(tmp_path, capsys):
    from towerrec.data.movielens import bundled_movielens_path

    out = tmp_path / "ml.json"
    args = ["data", "profile", str(bundled_movielens_path()), "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    assert "locality of MovieLens" in capsys.readouterr().out
    ml = LocalityProfile.load(out)
    assert [t.name for t in ml.tables] == ["user", "movie", "year", "genres", "tags"]
    assert ml.samples_profiled == ml.samples_total  # the whole training split
    user, movie = ml.table("user"), ml.table("movie")
    # Ratings come in sessions: a cache of 10% of the users hits far more than 10% of
    # the movies does.
    assert user.hit_rate_at["0.1"] > movie.hit_rate_at["0.1"] + 0.2
    # The synthetic default: an endless stream, --samples of it.
    synthetic = tmp_path / "syn.json"
    assert main(["data", "profile", "--samples", "2048", "--batch-size", "256",
                 "--out", str(synthetic), "--no-progress", "--json"]) == 0  # fmt: skip
    syn = LocalityProfile.load(synthetic)
    assert syn.samples_profiled == syn.samples_total == 2048 and len(syn.tables) == 9
    assert syn.table("cat_8").pooling_factor > 1  # the multi-hot table


def test_a_cache_directory_that_refuses_the_profile_sends_it_here(tmp_path, monkeypatch, capsys):
    days = generate_criteo_files(tmp_path / "raw", files=1, rows_per_file=300, seed=1)
    cache = tmp_path / "cache"
    preprocess_criteo(days, cache, CriteoOptions(num_embeddings=(50,)), progress=False)
    (cache / PROFILE_NAME).mkdir()  # the profile's name taken: writing there fails
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["data", "profile", str(cache), "--no-progress", "--batch-size", "64"]) == 0
    assert "cannot write into the cache directory" in capsys.readouterr().out
    assert len(LocalityProfile.load(here / PROFILE_NAME).tables) == 26
    assert main(["data", "profile", str(cache), "--out", str(cache / PROFILE_NAME)]) == 2
    assert "choose another --out" in capsys.readouterr().err


def test_the_benchmarks_second_pass_check_reads_two_epochs():
    from towerrec.bench.locality import two_epoch_streams, validate_curve

    store, part = _store(500, seed=4)
    source = ColumnSource(store, LoaderConfig(seed=1))
    streams = two_epoch_streams(source, 64)  # 500 rows: batches run across the epoch end
    ids, split = streams["a"]
    assert split == 500 and len(ids) == 1000
    first = np.concatenate([source.train_batch(i, 64).sparse.to_dict()["a"].values.numpy()
                            for i in range(8)])[:500]  # fmt: skip
    assert ids[:500].tolist() == first.tolist()
    ids, split = streams["m"]
    assert split == int(part.multi["m"][1][-1])  # the multi-hot feature's ids of one pass
    rows = validate_curve(source, 64, fractions=(0.1,))
    a = next(r for r in rows if r["table"] == "a")
    assert a["predicted"] == pytest.approx(lru_hits(first.tolist(), 5) / 500)
    both = streams["a"][0].tolist()  # a 5-row LRU warmed on pass one, scored on pass two
    assert a["second_pass"] == pytest.approx((lru_hits(both, 5) - lru_hits(both[:500], 5)) / 500)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--real-cache"], "--real-cache goes with --validate"),
        (["--validate", "--shares", "0.1,x"], "--shares takes numbers"),
        (["--validate", "--shares", "0,0.5"], r"--shares must lie in \(0, 1\]"),
    ],
)
def test_locality_bench_names_bad_flags(argv, match):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["locality"].add_arguments(parser)
    with pytest.raises(ValueError, match=match):
        BENCHMARKS["locality"].run(parser.parse_args(argv))
