"""The id wire format (``distributed/id_wire.py``): exact round trips, narrow types,
deduplication only where it is smaller, and sizes counted by hand."""

import pytest
import torch

from towerrec.bench.id_wire import run_id_wire_benchmark
from towerrec.config import load_config
from towerrec.distributed.id_wire import IdWire, narrowest_itemsize


def _jagged(gen, keys, batch, rows, max_len):
    lengths = torch.randint(0, max_len + 1, (keys, batch), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return lengths, values


@pytest.mark.parametrize("wire", [IdWire(), IdWire(False), IdWire(True, where_smaller=False)])
@pytest.mark.parametrize(
    "keys,batch,rows,max_len",
    [
        (3, 16, 10, 4),  # many repeats: deduplicated, uint8 ids and index
        (2, 8, 2**20, 3),  # few repeats: plain, int32 ids
        (1, 4, 2**40, 2),  # ids beyond int32: int64
        (2, 5, 50, 300),  # bags longer than 255: int16 lengths, int16 index
        (4, 3, 70_000, 0),  # no ids at all
        (1, 1, 5, 1),
    ],
)
def test_round_trip_is_exact(wire, keys, batch, rows, max_len):
    gen = torch.Generator().manual_seed(keys * 1000 + batch)
    lengths, values = _jagged(gen, keys, batch, rows, max_len)
    payload = wire.encode(lengths, values)
    assert payload.dtype == torch.uint8
    got_lengths, got_values = wire.decode(payload, keys, batch)
    assert got_lengths.dtype == got_values.dtype == torch.int64
    assert torch.equal(got_lengths, lengths)
    assert torch.equal(got_values, values)


def test_several_sources_back_to_back():
    gen = torch.Generator().manual_seed(0)
    parts = [_jagged(gen, 3, b, 40, 3) for b in (5, 0, 7)]
    wire = IdWire()
    payloads = [wire.encode(ln, v) for ln, v in parts]
    decoded = wire.decode_all(torch.cat(payloads), [p.numel() for p in payloads], 3, [5, 0, 7])
    for (ln, v), (got_ln, got_v) in zip(parts, decoded):
        assert torch.equal(got_ln, ln) and torch.equal(got_v, v)


def test_sizes_by_hand():
    """A header of 3 + 3 x 2 int32; 6 bags of 2 ids; key 0's ids under 256, key 1's not."""
    lengths = torch.full((2, 3), 2)  # 2 keys x 3 samples, 12 ids
    values = torch.tensor([7, 7, 9, 7, 9, 9, 900, 900, 900, 3, 3, 900])
    header, bags = 4 * 9, 6
    plain = IdWire(False).encode(lengths, values)
    assert plain.numel() == header + 6 * 1 + 6 * 2 + bags  # uint8 ids, int16 ids
    # deduplicated where smaller: key 1 (2 int16 ids + 6 one-byte indexes = 10 < 12 bytes);
    # key 0 would take 2 + 6 = 8 > 6 bytes and is sent plain
    assert IdWire(True).encode(lengths, values).numel() == header + 6 + 2 * 2 + bags + 6
    # forced: both keys
    forced = IdWire(True, where_smaller=False).encode(lengths, values)
    assert forced.numel() == header + 2 + 2 * 2 + bags + 6 + 6
    wide = values + 2**20  # int32 ids: both keys pay (2 x 4 + 6 < 6 x 4)
    assert IdWire(False).encode(lengths, wide).numel() == header + 12 * 4 + bags
    assert IdWire(True).encode(lengths, wide).numel() == header + 2 * (2 * 4 + 6) + bags
    # per-id weights: one float32 per occurrence appended, deduplicated ids or not
    weights = torch.rand(12)
    assert IdWire(False).encode(lengths, values, weights).numel() == plain.numel() + 12 * 4
    assert (
        IdWire(True, where_smaller=False).encode(lengths, values, weights).numel()
        == forced.numel() + 12 * 4
    )


@pytest.mark.parametrize("wire", [IdWire(), IdWire(False), IdWire(True, where_smaller=False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_travel_with_their_ids(wire, dtype):
    """Ids, lengths and per-id weights in one payload per source: every weight comes back
    bit for bit beside its id, whether the ids were deduplicated or not."""
    gen = torch.Generator().manual_seed(3)
    parts = [_jagged(gen, 3, b, 12, 4) for b in (6, 0, 9)]
    weights = [torch.rand(v.numel(), generator=gen, dtype=dtype) for _, v in parts]
    payloads = [wire.encode(ln, v, w) for (ln, v), w in zip(parts, weights)]
    sizes = [p.numel() for p in payloads]
    decoded, got = wire.decode_all_weighted(torch.cat(payloads), sizes, 3, [6, 0, 9])
    for (ln, v), (got_ln, got_v) in zip(parts, decoded):
        assert torch.equal(got_ln, ln) and torch.equal(got_v, v)
    assert got is not None and got.dtype == dtype
    assert torch.equal(got, torch.cat(weights))
    # the plain decode reads the ids of a weighted payload alike
    assert torch.equal(wire.decode(payloads[0], 3, 6)[1], parts[0][1])
    # without weights: none come back
    bare = [wire.encode(ln, v) for ln, v in parts]
    _, none = wire.decode_all_weighted(torch.cat(bare), [p.numel() for p in bare], 3, [6, 0, 9])
    assert none is None


def test_weights_and_versions_are_checked():
    lengths, values = torch.full((1, 2), 2), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"give float32 \(or float64\) weights"):
        IdWire().encode(lengths, values, torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"3 per-id weights for 4 ids; give one weight per id"):
        IdWire().encode(lengths, values, torch.ones(3))
    weighted = IdWire().encode(lengths, values, torch.ones(4))
    bare = IdWire().encode(lengths, values)
    with pytest.raises(ValueError, match=r"some ranks' id payloads carry per-id weights"):
        IdWire().decode_all_weighted(
            torch.cat([weighted, bare]), [weighted.numel(), bare.numel()], 1, [2, 2]
        )
    old = bare.clone()
    old[:4] = torch.tensor([1], dtype=torch.int32).view(torch.uint8)  # a version-1 header
    with pytest.raises(ValueError, match=r"wire version 1, this towerrec reads version 2"):
        IdWire().decode(old, 1, 2)


def test_dedup_is_skipped_where_it_would_grow_the_payload():
    lengths = torch.ones(1, 6, dtype=torch.int64)
    values = torch.arange(6) + 1000  # all distinct
    assert (
        IdWire(True).encode(lengths, values).numel()
        == IdWire(False).encode(lengths, values).numel()
    )


def test_no_keys_no_bytes():
    empty = IdWire().encode(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert empty.numel() == 0
    lengths, values = IdWire().decode(empty, 0, 4)
    assert lengths.shape == (0, 4) and values.numel() == 0


def test_narrowest_itemsize():
    assert [narrowest_itemsize(x) for x in (0, 255, 256, 2**15 - 1, 2**15)] == [1, 1, 2, 2, 4]
    assert narrowest_itemsize(2**31 - 1) == 4 and narrowest_itemsize(2**31) == 8


def test_dedup_ids_config():
    assert load_config(None, []).distributed.dedup_ids is True
    assert load_config(None, ["distributed.dedup_ids=false"]).distributed.dedup_ids is False
    with pytest.raises(ValueError, match=r"distributed.dedup_ids must be true or false"):
        load_config(None, ["distributed.dedup_ids=sometimes"])


def test_bench_id_wire_on_the_default_data():
    result = run_id_wire_benchmark(batch_size=64, batches=2)
    sizes = result["bytes_per_sample"]
    assert result["batches"] == 2 and result["features"] == 9
    # every length and id as 8 bytes before; the default tables' ids fit 1 or 2 bytes
    assert sizes["int64"] == 8 * (9 + result["ids_per_sample"])
    assert sizes["narrow_dedup"] <= sizes["narrow"] < sizes["int64"] / 4
    with pytest.raises(ValueError, match=r"--batches \(0\) must be >= 1"):
        run_id_wire_benchmark(batches=0)
