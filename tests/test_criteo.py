"""Criteo TSV -> cache: values against a line-by-line reference, splits, resume, bad input."""

import gzip
import json
import math
import os
import re
from collections import Counter

import numpy as np
import pytest

from towerrec.data.cache import CacheError, open_cache
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_file
from towerrec.data.text_input import MalformedInputError

SIZE = 997


def reference_rows(paths):
    """Line-by-line parse with Python: (label, dense[13], raw categorical values or None)."""
    rows = []
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt") as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:14]]
                cats = [int(v, 16) if v else None for v in fields[14:]]
                rows.append((float(fields[0]), dense, cats))
    return rows


def hashed(cats, size=SIZE):
    return [0 if v is None else 1 + v % (size - 1) for v in cats]


def split_arrays(store, split):
    parts = store.splits.get(split, [])
    return (
        np.concatenate([p.labels for p in parts]),
        np.concatenate([p.dense for p in parts]),
        np.concatenate([p.sparse for p in parts]),
    )


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    root = tmp_path_factory.mktemp("criteo")
    plain = generate_criteo_file(root / "day_0", 3000, seed=1, file_index=0)
    packed = generate_criteo_file(root / "day_1.gz", 2000, seed=1, file_index=1, gzip_output=True)
    return [plain, packed]


def test_cache_matches_reference_parse(days, tmp_path):
    options = CriteoOptions(num_embeddings=(SIZE,), eval_files=("day_1.gz",), chunk_bytes=100_000)
    manifest = preprocess_criteo(days, tmp_path / "cache", options, progress=False)
    assert manifest["rows"] == {"train": 3000, "validation": 2000, "test": 0}
    assert manifest["report"]["malformed"] == 0
    store = open_cache(tmp_path / "cache")
    reference = reference_rows(days)
    for split, expected in (("train", reference[:3000]), ("validation", reference[3000:])):
        labels, dense, sparse = split_arrays(store, split)
        np.testing.assert_array_equal(labels, [r[0] for r in expected])
        np.testing.assert_allclose(dense, [r[1] for r in expected], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(sparse, [hashed(r[2]) for r in expected])
    assert 0.1 < labels.mean() < 0.5  # a Criteo-like click rate
    assert [f.num_embeddings for f in store.schema.sparse] == [SIZE] * 26


def test_vocabulary_mode_matches_counter(days, tmp_path):
    options = CriteoOptions(min_count=3, eval_files=("day_1.gz",), chunk_bytes=50_000)
    manifest = preprocess_criteo(days, tmp_path / "cache", options, progress=False)
    store = open_cache(tmp_path / "cache")
    reference = reference_rows(days)
    train, evaluation = reference[:3000], reference[3000:]
    # Values of the held-out day never seen (>= 3 times) in training: the OOV row, counted.
    for split, rows in (("train", train), ("validation", evaluation)):
        vocabs = [
            {v for v, c in Counter(r[2][j] for r in train if r[2][j] is not None).items() if c >= 3}
            for j in range(26)
        ]
        unseen = sum(
            1 for r in rows for j in range(26) if r[2][j] is not None and r[2][j] not in vocabs[j]
        )
        assert manifest["report"]["out_of_vocabulary"][split] == unseen > 0, split
    for j in (0, 2, 25):
        counts = Counter(r[2][j] for r in train if r[2][j] is not None)
        vocab = sorted(v for v, c in counts.items() if c >= 3)
        ids = {v: i + 1 for i, v in enumerate(vocab)}
        assert store.schema.sparse[j].num_embeddings == len(vocab) + 1
        for split, rows in (("train", train), ("validation", evaluation)):
            expected = [ids.get(r[2][j], 0) for r in rows]
            np.testing.assert_array_equal(split_arrays(store, split)[2][:, j], expected)


def test_eval_fraction_is_seeded_and_independent_of_chunking(days, tmp_path):
    a = preprocess_criteo(
        days, tmp_path / "a", CriteoOptions(eval_fraction=0.25, chunk_bytes=32_768), progress=False
    )
    b = preprocess_criteo(
        days, tmp_path / "b", CriteoOptions(eval_fraction=0.25, threads=1), progress=False
    )
    c = preprocess_criteo(
        days, tmp_path / "c", CriteoOptions(eval_fraction=0.25, seed=7), progress=False
    )
    assert a["rows"] == b["rows"] and a["rows"]["train"] + a["rows"]["validation"] == 5000
    assert 0.2 < a["rows"]["validation"] / 5000 < 0.3
    stores = [open_cache(tmp_path / name) for name in "abc"]
    np.testing.assert_array_equal(
        split_arrays(stores[0], "validation")[2], split_arrays(stores[1], "validation")[2]
    )
    assert a["rows"] != c["rows"] or not np.array_equal(
        split_arrays(stores[0], "validation")[2], split_arrays(stores[2], "validation")[2]
    )


def test_resume_reuses_finished_files(days, tmp_path, caplog):
    out = tmp_path / "cache"
    options = CriteoOptions(num_embeddings=(SIZE,))
    first = preprocess_criteo(days, out, options, progress=False)
    finished = out / "parts" / "00000-day_0"
    stamp = (finished / "train.sparse.bin").stat().st_mtime_ns
    # An interrupted run: the second file's part never finished, the manifest is gone.
    os.rename(out / "parts" / "00001-day_1.gz", out / "parts" / "00001-day_1.gz.partial")
    (out / "manifest.json").unlink()
    with pytest.raises(CacheError, match="not a finished cache"):
        open_cache(out)
    with caplog.at_level("INFO", logger="towerrec"):
        second = preprocess_criteo(days, out, options, progress=False)
    assert "reused 1 finished part" in caplog.text
    assert (finished / "train.sparse.bin").stat().st_mtime_ns == stamp
    assert second["rows"] == first["rows"]
    assert [p["files"] for p in second["parts"]] == [p["files"] for p in first["parts"]]
    assert not (out / "parts" / "00001-day_1.gz.partial").exists()
    # Different options: nothing is reused.
    third = preprocess_criteo(days, out, CriteoOptions(num_embeddings=(SIZE + 1,)), progress=False)
    assert third["parts"][0]["files"] != first["parts"][0]["files"]


GOOD = "\t".join(["1", *["3"] * 13, *["0a1b2c3d"] * 26])


def write_lines(path, lines, end="\n"):
    path.write_text("\n".join(lines) + end)
    return path


def test_malformed_rows_are_skipped_counted_and_located(tmp_path):
    fields = GOOD.split("\t")
    bad_int = "\t".join([*fields[:3], "x7", *fields[4:]])
    bad_hex = "\t".join([*fields[:20], "0a1g2c3d", *fields[21:]])
    bad_label = "\t".join(["2", *fields[1:]])
    short = "\t".join(fields[:-1])
    long = GOOD + "\tdeadbeef"
    lines = [GOOD, short, GOOD, bad_int, bad_hex, GOOD, long, "", bad_label, GOOD, GOOD[:50]]
    path = write_lines(tmp_path / "day_0", lines)
    manifest = preprocess_criteo([path], tmp_path / "cache", progress=False)
    report = manifest["report"]
    assert manifest["rows"]["train"] == 4
    assert report["malformed"] == 7
    assert report["by_reason"] == {
        "wrong field count": 3,
        "empty line": 1,
        "I3 is not an integer": 1,
        "C7 is not hexadecimal": 1,
        "label is not 0 or 1": 1,
    }
    positions = [entry.split(": ")[0] for entry in report["first"]]
    assert positions == [f"{path}:{n}" for n in (2, 4, 5, 7, 8)]
    # The vocabulary's counting pass does not count them twice.
    vocab = preprocess_criteo(
        [path], tmp_path / "vocab", CriteoOptions(min_count=1), progress=False
    )
    assert vocab["report"]["malformed"] == 7 and vocab["rows"]["train"] == 4
    # Kept rows are the good ones, with nothing shifted.
    store = open_cache(tmp_path / "cache")
    labels, dense, sparse = split_arrays(store, "train")
    np.testing.assert_array_equal(labels, [1, 1, 1, 1])
    np.testing.assert_allclose(dense, np.full((4, 13), math.log1p(3)), rtol=1e-6)
    np.testing.assert_array_equal(sparse, np.full((4, 26), 1 + 0x0A1B2C3D % (100_000 - 1)))


@pytest.mark.parametrize(
    "line, where, reason",
    [
        ("\t".join(GOOD.split("\t")[:30]), 2, "wrong field count"),
        (GOOD.replace("\t3\t", "\t3.5\t", 1), 2, "I1 is not an integer"),
        (GOOD[: GOOD.rfind("\t")] + "\t0a1b2c3z", 2, "C26 is not hexadecimal"),
    ],
    ids=["short", "float", "hex"],
)
def test_strict_stops_at_the_first_malformed_row(tmp_path, line, where, reason):
    path = write_lines(tmp_path / "day_0", [GOOD, line, GOOD])
    with pytest.raises(MalformedInputError, match=rf"{path}:{where}: {reason}"):
        preprocess_criteo([path], tmp_path / "cache", CriteoOptions(strict=True), progress=False)
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_empty_files(tmp_path):
    empty = tmp_path / "day_0"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="no valid rows"):
        preprocess_criteo([empty], tmp_path / "c1", progress=False)
    good = write_lines(tmp_path / "day_1", [GOOD, GOOD])
    manifest = preprocess_criteo([empty, good], tmp_path / "c2", progress=False)
    assert manifest["rows"]["train"] == 2
    assert manifest["report"]["by_reason"] == {"empty file": 1}
    with pytest.raises(MalformedInputError, match="day_0: empty file"):
        preprocess_criteo(
            [empty, good], tmp_path / "c3", CriteoOptions(strict=True), progress=False
        )


def test_truncated_gzip_keeps_the_rows_before_the_cut(tmp_path):
    full = generate_criteo_file(tmp_path / "day_0.gz", 8_000, gzip_output=True)
    cut = tmp_path / "cut" / "day_0.gz"
    cut.parent.mkdir()
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    manifest = preprocess_criteo([cut], tmp_path / "cache", progress=False)
    report = manifest["report"]
    assert report["by_reason"] == {"gzip stream ends early": 1}
    kept = manifest["rows"]["train"]
    assert 2_000 < kept < 6_000
    line = int(report["first"][0].split(": ")[0].rsplit(":", 1)[1])
    assert line == kept + 1  # rows before the cut are kept, the partial line is dropped
    reference = reference_rows([full])[:kept]
    store = open_cache(tmp_path / "cache")
    np.testing.assert_array_equal(
        split_arrays(store, "train")[2], [hashed(r[2], 100_000) for r in reference]
    )
    with pytest.raises(MalformedInputError, match="gzip stream ends early"):
        preprocess_criteo([cut], tmp_path / "c2", CriteoOptions(strict=True), progress=False)


def test_verify_once_hashes_until_a_file_changes(days, tmp_path, monkeypatch):
    from towerrec.data import cache as cache_module

    out = tmp_path / "cache"
    preprocess_criteo(days[:1], out, CriteoOptions(num_embeddings=(SIZE,)), progress=False)
    hashed_files = []
    real = cache_module.sha256_file
    monkeypatch.setattr(
        cache_module, "sha256_file", lambda path: hashed_files.append(path) or real(path)
    )
    open_cache(out)  # default "once": hashes and records the check
    first = len(hashed_files)
    assert first > 0 and (out / cache_module.VERIFIED_STAMP).is_file()
    open_cache(out)
    assert len(hashed_files) == first  # nothing changed: no hashing
    target = out / "parts" / "00000-day_0" / "train.sparse.bin"
    data = bytearray(target.read_bytes())
    stat = target.stat()
    data[1234] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="does not match the checksum"):
        open_cache(out)  # the mtime moved: hashed again, corruption found
    assert not (out / cache_module.VERIFIED_STAMP).exists()
    # Corruption that keeps size and mtime (a failing disk) is what "always" is for.
    data[1234] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    open_cache(out)
    data[1234] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    open_cache(out, verify="once")  # same size and mtime: trusted
    with pytest.raises(CacheError, match="does not match the checksum"):
        open_cache(out, verify="always")
    with pytest.raises(ValueError, match=r"data\.loader\.verify"):
        open_cache(out, verify="sometimes")


def test_crlf_lines_give_the_same_cache(days, tmp_path):
    crlf = tmp_path / "day_0"
    crlf.write_bytes(days[0].read_bytes().replace(b"\n", b"\r\n"))
    options = CriteoOptions(num_embeddings=(SIZE,))
    preprocess_criteo([days[0]], tmp_path / "lf", options, progress=False)
    manifest = preprocess_criteo([crlf], tmp_path / "crlf", options, progress=False)
    assert manifest["report"]["malformed"] == 0
    for a, b in zip(
        split_arrays(open_cache(tmp_path / "lf"), "train"),
        split_arrays(open_cache(tmp_path / "crlf"), "train"),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_corrupt_cache_is_refused(days, tmp_path):
    out = tmp_path / "cache"
    preprocess_criteo(days[:1], out, CriteoOptions(num_embeddings=(SIZE,)), progress=False)
    target = out / "parts" / "00000-day_0" / "train.sparse.bin"
    data = bytearray(target.read_bytes())
    data[1234] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"does not match the checksum.*rebuild it"):
        open_cache(out)
    open_cache(out, verify=False)  # sizes still match: readable when asked not to verify
    target.write_bytes(bytes(data[:-8]))
    with pytest.raises(CacheError, match=r"has 311992 bytes, the manifest says 312000.*rebuild it"):
        open_cache(out, verify=False)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["manifest_sha256"]  # as a manifest of another version would not have it
    manifest["version"] = 99
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match=r"not a towerrec-cache version 1 manifest.*rebuild"):
        open_cache(out)


def test_a_changed_value_in_the_manifest_is_refused(days, tmp_path):
    """The manifest's digest of itself: a table size, a row count or a file's checksum
    changed in it (still valid JSON) is refused at every open, verified or not."""
    out = tmp_path / "cache"
    preprocess_criteo(days[:1], out, CriteoOptions(num_embeddings=(SIZE,)), progress=False)
    text = (out / "manifest.json").read_text()
    open_cache(out)
    rows = re.search(r'"train": (\d+)', text)
    digest = re.search(r'"train\.labels\.bin": "(\w)', text)
    assert rows and digest
    edits = [
        (f'"num_embeddings": {SIZE}', f'"num_embeddings": {SIZE + 1}'),
        (rows.group(0), f'"train": {int(rows.group(1)) + 1}'),
        (digest.group(0), digest.group(0)[:-1] + ("0" if digest.group(1) != "0" else "1")),
    ]
    for old, new in edits:
        assert old in text
        (out / "manifest.json").write_text(text.replace(old, new, 1))
        with pytest.raises(CacheError, match=r"manifest\.json does not match its own.*rebuild"):
            open_cache(out, verify=False)
    (out / "manifest.json").write_text(text)
    assert [f.num_embeddings for f in open_cache(out).schema.sparse] == [SIZE] * 26


def test_options_are_checked():
    with pytest.raises(ValueError, match="1 or 26 table sizes"):
        CriteoOptions(num_embeddings=(10, 20))
    with pytest.raises(ValueError, match="validation-fraction must lie in"):
        CriteoOptions(eval_fraction=1.0)
    with pytest.raises(ValueError, match="id 0 is reserved"):
        CriteoOptions(num_embeddings=(1,))


def test_generator_is_deterministic_and_criteo_like(tmp_path):
    a = generate_criteo_file(tmp_path / "a", 4000, seed=5)
    b = generate_criteo_file(tmp_path / "b", 4000, seed=5)
    c = generate_criteo_file(tmp_path / "c", 4000, seed=6)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    rows = [line.split("\t") for line in a.read_text().splitlines()]
    assert all(len(r) == 40 for r in rows)
    labels = np.array([int(r[0]) for r in rows])
    assert 0.15 < labels.mean() < 0.4
    missing = np.array([[v == "" for v in r[1:]] for r in rows]).mean(axis=0)
    assert missing[11] > 0.6 and missing[1] == 0  # I12 mostly missing, I2 never
    assert missing[13 + 18] > 0.3 and missing[13] == 0  # C19 often missing, C1 never
    hexes = [v for r in rows for v in r[14:] if v]
    assert all(len(v) == 8 for v in hexes) and all(int(v, 16) >= 0 for v in hexes[:1000])
    c3 = Counter(r[16] for r in rows)  # Zipf: a few values are frequent, most are rare
    assert c3.most_common(1)[0][1] > 100 and len(c3) > 500


@pytest.mark.parametrize(
    "texts",
    [
        ["0a1b2c3d", None, "FFFFFFFF", "00000000"],  # one width, nulls between
        ["0a1b2c3d", "ffffffff", "12345678"],  # one width, no nulls
        ["a", "0A1", None, "123456789abcdef0", "1" * 17, "12g4", "", "fF"],  # mixed
    ],
)
def test_decode_hex_against_python(texts):
    import pyarrow as pa

    from towerrec.data.text_input import decode_hex

    array = pa.array(texts, type=pa.string())
    _, offsets, data = array.buffers()
    values, bad = decode_hex(
        np.frombuffer(offsets, np.int32).astype(np.int64),
        np.frombuffer(data, np.uint8),
        array.is_valid().to_numpy(zero_copy_only=False),
    )
    for text, value, wrong in zip(texts, values.tolist(), bad.tolist()):
        try:
            expected = int(text, 16) if text and len(text) <= 16 else 0
            invalid = bool(text) and len(text) > 16
        except ValueError:
            expected, invalid = 0, True
        assert (value, wrong) == (expected, invalid), text


def test_table_sizes_beyond_the_caches_int32_ids_are_refused_not_wrapped():
    with pytest.raises(ValueError, match=r"at most 2,147,483,647 .* would wrap"):
        CriteoOptions(num_embeddings=(2**40,))
    CriteoOptions(num_embeddings=(2**31 - 1,))  # the largest that fits
    from towerrec.data.batch import DataSchema, SparseFeature
    from towerrec.data.cache import schema_to_manifest

    wide = DataSchema(num_dense=0, sparse=(SparseFeature("cat_0", 2**31),))
    with pytest.raises(CacheError, match=r"'cat_0'.*int32"):
        schema_to_manifest(wide, set())
