"""The same code on a CUDA device: skipped where no GPU is present (CI has none).

Each check compares the CUDA run with the CPU run of the same model and data, or (cached
tables) with the same model holding every table in GPU memory.
"""

import json

import pytest
import test_cache_device_maps as maps_tests
import test_cached_embedding as cached_tests
import test_kv_store as kv_tests
import torch
from test_embedding import TABLES, random_batch, train_steps

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import load_config
from towerrec.data.batch import Batch
from towerrec.data.synthetic import SyntheticSource
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tiers import TierConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.pipeline import pipelined
from towerrec.train.step import train_step
from towerrec.workflows import training as trainer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad", "sgd"])
def test_torch_kernel_on_cuda_matches_cpu(kind):
    opt = EmbeddingOptimizerConfig(kind=kind, lr=0.1)
    cpu = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=3)
    gpu = EmbeddingBagCollection(TABLES, opt, backend="torch", seed=3).to(torch.device("cuda"))
    cpu_out, gpu_out = train_steps(cpu, 10), _train_on_cuda(gpu, 10)
    for a, b in zip(cpu_out, gpu_out, strict=True):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-5)
    for name, weight in cpu.table_weights().items():
        torch.testing.assert_close(weight, gpu.table_weights()[name].cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "opt",
    [
        {"kind": "adam"},
        {"kind": "adam", "weight_decay": 0.01, "beta1": 0.8, "beta2": 0.99},
        {"kind": "partial_rowwise_adam"},
        {"kind": "partial_rowwise_adam", "weight_decay": 0.01},
        {"weight_decay": 0.01, "weight_decay_mode": "l2"},
        {"weight_decay": 0.01, "weight_decay_mode": "decoupled"},
    ],
)
def test_fbgemm_adam_and_weight_decay_equal_the_torch_kernel(opt):
    """FBGEMM's Adam kernels (CUDA only) and weight decay against the torch kernel: 10
    steps on the same batches, with an evaluation lookup between steps (not counted)."""
    pytest.importorskip("fbgemm_gpu")
    opt = EmbeddingOptimizerConfig(lr=0.05, **opt)
    runs = {
        b: EmbeddingBagCollection(TABLES, opt, backend=b, seed=3, device="cuda")
        for b in ("torch", "fbgemm")
    }
    outs = {}
    for backend, ebc in runs.items():
        outs[backend] = _train_on_cuda(ebc, 5)
        with torch.no_grad():
            ebc(random_batch(torch.Generator().manual_seed(7)).to(torch.device("cuda")))
        outs[backend] += _train_on_cuda(ebc, 5, seed=1)
    for a, b in zip(outs["torch"], outs["fbgemm"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name, weight in runs["torch"].table_weights().items():
        torch.testing.assert_close(
            weight, runs["fbgemm"].table_weights()[name], rtol=1e-4, atol=1e-5
        )
    states = {b: ebc.optimizer_state_dict() for b, ebc in runs.items()}
    assert states["torch"].keys() == states["fbgemm"].keys()
    for key, value in states["torch"].items():
        torch.testing.assert_close(value, states["fbgemm"][key], rtol=1e-4, atol=1e-6)


def _train_on_cuda(ebc, steps, seed=0):
    """``train_steps`` with the batches and output gradients made on the CPU, then moved."""
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(steps):
        out = ebc(random_batch(gen).to(torch.device("cuda"))).values()
        out.backward(torch.randn(out.shape, generator=gen).cuda())
        outputs.append(out.detach())
    return outputs


def test_dlrm_step_on_cuda_matches_cpu():
    config = load_config(
        None,
        [
            "data.synthetic.num_embeddings=[60, 30, 90]",
            "data.synthetic.pooling_factors=[1, 2, 1]",
            "embedding.backend=torch",
        ],
    )
    source = SyntheticSource(config.data.synthetic)
    losses = {}
    for name in ("cpu", "cuda"):
        device = torch.device(name)
        model = build_model(config, source.schema, device)
        optimizer = build_dense_optimizer(config.optimizer, model)
        batches = source.train_batches(256)
        losses[name] = [
            float(train_step(model, optimizer, next(batches).to(device))) for _ in range(5)
        ]
    torch.testing.assert_close(losses["cpu"], losses["cuda"], rtol=1e-4, atol=1e-5)


def test_quick_run_on_cuda(tmp_path):
    config = load_config(
        "configs/quick.toml",
        ["train.device=cuda", "embedding.backend=auto", "train.progress=false"],
    )
    summary = trainer.train(config, tmp_path / "run")
    assert summary["device"].startswith("cuda")
    assert 0.5 < summary["auc"] <= summary["oracle_auc"] + 0.02
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 60


# ------------------------------------------------- cached tables: slot tables on the GPU
def _train_step(collection, features):
    """``test_cached_embedding.train_step`` with its loss's weights on the output's device."""
    pooled = collection(features).values()
    weights = torch.arange(pooled.numel(), device=pooled.device).view_as(pooled).sin()
    (pooled * weights).sum().backward()
    return pooled.detach()


def _same_tables_on_host(reference, collection):
    """``cached_tests.assert_same_tables`` for collections on different devices."""
    ref_w, got_w = reference.table_weights(), collection.table_weights()
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert torch.equal(ref_w[name].cpu(), got_w[name].cpu()), name
    ref_s, got_s = reference.optimizer_state_dict(), collection.optimizer_state_dict()
    assert ref_s.keys() == got_s.keys()
    for key in ref_s:
        assert torch.equal(ref_s[key].cpu(), got_s[key].cpu()), key


@pytest.mark.parametrize("backing", ["host", "ssd"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("backend", ["torch", "fbgemm"])
@pytest.mark.parametrize("maps", ["device", "host"])
def test_cached_training_on_cuda_equals_gpu_memory_bit_for_bit(
    tmp_path, backing, policy, backend, maps
):
    """The cache in GPU memory over host or SSD stores, its bookkeeping on the GPU or the
    host: 50 steps with misses and write-backs every step equal the tables held whole in
    GPU memory, bit for bit."""
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    reference = EmbeddingBagCollection(cached_tests.TABLES, backend=backend, seed=3, device=CUDA)
    collection = maps_tests.cached(tmp_path, maps, backing, policy, backend).to(CUDA)
    assert set(collection.caches) == {"a", "b"}
    assert all(c.on_device == (maps == "device") for c in collection.caches.values())
    assert all(w.is_cuda for w in collection._inner.table_weights().values())  # the slots
    misses = {name: 0 for name in collection.caches}
    for step, features in enumerate(cached_tests.batches(50)):
        features = features.to(CUDA)
        expected = _train_step(reference, features)
        got = _train_step(collection, features)
        assert got.is_cuda and torch.equal(expected, got), step
        for name, stats in collection.cache_stats().items():
            assert stats.misses > misses[name], f"no miss in {name} at {step}"
            misses[name] = stats.misses
    assert all(s.written_back > 0 for s in collection.cache_stats().values())
    _same_tables_on_host(reference, collection)
    with torch.no_grad():  # evaluation after training: the same pooled values
        for features in cached_tests.batches(3, seed=9):
            features = features.to(CUDA)
            assert torch.equal(reference(features).values(), collection(features).values())


def test_cached_prefetch_on_cuda_equals_gpu_memory(tmp_path):
    """The training pipeline's background read of the next batch's misses, with batches
    on the GPU and evaluations between steps that evict rows read ahead."""
    reference = EmbeddingBagCollection(cached_tests.TABLES, backend="torch", seed=3, device=CUDA)
    collection = cached_tests.cached(tmp_path, "ssd", c=TierConfig()).to(CUDA)
    model = torch.nn.Sequential(collection)
    batch = cached_tests.BATCH
    stream = (
        Batch(torch.zeros(batch, 1), f, torch.zeros(batch)).to(CUDA)
        for f in cached_tests.batches(40)
    )
    for step, b in enumerate(pipelined(model, stream)):
        expected = _train_step(reference, b.sparse)
        assert torch.equal(expected, _train_step(collection, b.sparse)), step
        if step % 3 == 0:
            with torch.no_grad():
                (features,) = cached_tests.batches(1, seed=100 + step, batch=64)
                features = features.to(CUDA)
                assert torch.equal(reference(features).values(), collection(features).values())
    assert all(s.prefetched > 0 for s in collection.cache_stats().values())
    _same_tables_on_host(reference, collection)


def test_kv_tables_on_cuda_equal_a_host_cache(tmp_path):
    """Kv stores under slot tables on the GPU: the same as a host-backed cache started
    from the same per-row init, on the GPU too."""
    host = kv_tests.collection("host", tmp_path)
    kv_tests.init_host_per_row(host)
    host, kv = host.to(CUDA), kv_tests.collection("kv", tmp_path / "kv").to(CUDA)
    for step, features in enumerate(kv_tests.batches(30)):
        features = features.to(CUDA)
        expected, got = _train_step(host, features), _train_step(kv, features)
        assert torch.equal(expected, got), step
    assert all(s.written_back > 0 for s in kv.cache_stats().values())


def test_cached_run_on_cuda_resumes_and_equals_the_gpu_memory_run(tmp_path):
    """`towerrec train` on the GPU with SSD-cached tables, stopped at step 6 and resumed,
    ends with the checkpoint and AUC of an uninterrupted run with the tables in GPU
    memory."""
    from test_trainer import final_state

    in_memory, cached_run = cached_tests.resume_configs(tmp_path, "train.device=cuda")
    full = trainer.train(in_memory, tmp_path / "full")
    trainer.train(cached_run, tmp_path / "split", stop_after=6)
    resumed = trainer.train(cached_run, tmp_path / "split", resume=True)
    assert resumed["device"].startswith("cuda") and resumed["steps"] == 16
    assert resumed["cache"]["total"]["rows_written_back"] > 0
    a = final_state(tmp_path / "full", in_memory)
    b = final_state(tmp_path / "split", in_memory)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["auc"] == full["auc"]


def test_movielens_cached_on_cuda_equals_gpu_memory(tmp_path):
    """The bundled MovieLens on the GPU: the user and movie tables cached at 30% over
    host memory end with the in-memory run's metrics exactly."""
    sets = ["train.device=cuda", "train.steps=40", "train.eval_every=0", "train.progress=false"]
    summaries = {}
    for name, extra in {
        "memory": [],
        "cached": [
            "embedding.memory=cached",
            "embedding.cache_fraction=0.3",
            "embedding.cache_min_rows=1000",
        ],
    }.items():
        config = load_config("configs/movielens.toml", [*sets, *extra])
        summaries[name] = trainer.train(config, tmp_path / name)
    assert summaries["cached"]["cache"]  # tables were cached
    for key in ("auc", "logloss", "ne"):
        assert summaries["cached"][key] == summaries["memory"][key], key


def test_device_bookkeeping_never_copies_a_batchs_ids_to_the_host(tmp_path, monkeypatch):
    """With the maps on the GPU, the ids a lookup hands the host are its misses alone
    (to read the store), and the write-backs its dirty victims: counted at the store."""
    from towerrec.modules import cached as cached_module

    asked = []
    on = cached_module._BatchIds.on
    monkeypatch.setattr(
        cached_module._BatchIds, "on", lambda self, d: asked.append(d.type) or on(self, d)
    )
    collection = maps_tests.cached(tmp_path, "device").to(CUDA)
    read = {name: 0 for name in collection.caches}
    for name, cache in collection.caches.items():
        store_read = cache.store.read

        def counting(ids, name=name, store_read=store_read):
            assert ids.device.type == "cpu"
            read[name] += ids.numel()
            return store_read(ids)

        monkeypatch.setattr(cache.store, "read", counting)
    for features in cached_tests.batches(20):
        _train_step(collection, features.to(CUDA))
    assert asked and set(asked) == {"cuda"}
    for name, stats in collection.cache_stats().items():
        assert read[name] == stats.misses == stats.rows_read  # no prefetch here


def test_bench_paths_run_on_cuda(tmp_path):
    """The GPU benchmarks' code at small sizes: the plain peer, the roofline, the link
    bound and the DMT compute."""
    from test_bench_device import small_tiers, small_train, tiny_shapes

    from towerrec.bench.dmt_compute import run_dmt_compute

    train = small_train("cuda")
    assert train["device"] == torch.cuda.get_device_name()
    assert all(r["roofline_fraction"] > 0 for r in train["precisions"]["fp32"]["results"].values())
    tiers = small_tiers(tmp_path, "cuda")
    assert tiers["results"]["host"]["link_bound_samples_per_s"] > 0
    assert run_dmt_compute(tiny_shapes(), "cuda", repeats=2)["shapes"][0]["fp32"]["parts"]


def test_plain_peer_computes_towerrecs_dlrm_on_cuda():
    from test_bench_device import assert_peer_equals_towerrec

    assert_peer_equals_towerrec(CUDA)
