"""The speed paths compute what the plain formulation computes (the one-bmm
interaction backward, 8-aligned linear layers, in-place ReLU, fused optimizers);
the ``auto`` backend rule; the benchmark commands run and report every system.
No timing is asserted."""

import pytest
import torch
from conftest import needs_torchrec, run_cli
from torch import nn

from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.interaction import DotInteraction
from towerrec.modules.kernels import Backend, auto_backend, fbgemm_available, resolve_backend
from towerrec.modules.mlp import MLP, aligned_linear, padding_for
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizer
from towerrec.sparse import KeyedJaggedTensor


def reference_dots(x, self_interaction):
    """Autograd through bmm + gather: two bmms and a sum in backward."""
    f = x.shape[1]
    rows, cols = torch.triu_indices(f, f, offset=0 if self_interaction else 1)
    return torch.bmm(x, x.transpose(1, 2))[:, rows, cols]


@pytest.mark.parametrize("self_interaction", [False, True])
def test_interaction_gradient_matches_autograd_reference(self_interaction):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 3, dtype=torch.float64, requires_grad=True)
    module = DotInteraction(5, self_interaction)
    grad = torch.randn(6, module.out_features, dtype=torch.float64)
    (ours,) = torch.autograd.grad(module(x), x, grad)
    (theirs,) = torch.autograd.grad(reference_dots(x, self_interaction), x, grad)
    torch.testing.assert_close(ours, theirs)
    assert torch.autograd.gradcheck(lambda t: module(t), (x,))


@pytest.mark.parametrize("dim", [8, 16])  # 16: the fused CPU kernel, where it is built
def test_interaction_under_bf16_autocast_runs_in_bf16_and_backpropagates(dim):
    torch.manual_seed(0)
    x = torch.randn(4, 3, dim, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = DotInteraction(3)(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    x64 = x.detach().double().requires_grad_()
    reference_dots(x64, False).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0.05, atol=0.05)


def reference_mlp(mlp: MLP) -> nn.Sequential:
    """The same layers run by nn.Sequential (unpadded matmuls, out-of-place ReLU)."""
    return nn.Sequential(*[nn.ReLU() if isinstance(m, nn.ReLU) else m for m in mlp])


@pytest.mark.parametrize("widths", [(13, [24, 16]), (367, [32, 1]), (100, [5, 3]), (3, [4])])
def test_aligned_mlp_matches_plain_sequential_outputs_and_gradients(widths):
    in_features, sizes = widths
    torch.manual_seed(0)
    mlp = MLP(in_features, sizes, final_activation=False).double()
    x = torch.randn(7, in_features, dtype=torch.float64, requires_grad=True)
    ours = mlp(x)
    ours_grads = torch.autograd.grad(ours.sum(), [x, *mlp.parameters()])
    theirs = reference_mlp(mlp)(x)
    theirs_grads = torch.autograd.grad(theirs.sum(), [x, *mlp.parameters()])
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(ours_grads, theirs_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)
    # the state dict is that of the plain layers: no padded shapes leak out
    assert mlp[0].weight.shape == (sizes[0], in_features)


def test_padding_rule_and_prepadded_input():
    assert [padding_for(n) for n in (3, 13, 63, 64, 65, 367, 368)] == [0, 0, 0, 0, 7, 1, 0]
    torch.manual_seed(0)
    layer = nn.Linear(67, 4).double()
    x = torch.randn(5, 67, dtype=torch.float64)
    padded = torch.cat([x, x.new_zeros(5, 5)], dim=1)
    torch.testing.assert_close(aligned_linear(padded, layer), layer(x))
    torch.testing.assert_close(aligned_linear(x, layer), layer(x))
    with pytest.raises(RuntimeError):
        aligned_linear(torch.randn(5, 66, dtype=torch.float64), layer)


def tiny_dlrm(seed: int = 0) -> DLRM:
    tables = [TableConfig(f"t{i}", 20, 4) for i in range(12)]
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables, backend="torch")
    return DLRM(ebc, num_dense=13, bottom_mlp=[16, 4], top_mlp=[8, 1])


def test_dlrm_logits_equal_the_unpadded_formulation():
    """The top MLP's input (4 + 78 = 82 columns) is padded inside the concat."""
    model = tiny_dlrm().double()
    assert model.top.input_padding == 6
    gen = torch.Generator().manual_seed(1)
    sparse = KeyedJaggedTensor(
        [f"t{i}" for i in range(12)],
        torch.randint(0, 20, (12 * 6,), generator=gen),
        torch.ones(12 * 6, dtype=torch.int64),
    )
    dense = torch.randn(6, 13, dtype=torch.float64, generator=gen)
    x = reference_mlp(model.bottom)(dense)
    stacked = torch.cat([x.unsqueeze(1), model.sparse(sparse).stacked().double()], dim=1)
    expected = reference_mlp(model.top)(torch.cat([x, reference_dots(stacked, False)], 1))
    torch.testing.assert_close(model(dense, sparse), expected.squeeze(1))


@pytest.mark.parametrize(
    "device, capability, installed, optimizer, expected",
    [
        ("cpu", "AVX2", True, EmbeddingOptimizer.ROWWISE_ADAGRAD, Backend.TORCH),
        ("cpu", "AVX512", True, EmbeddingOptimizer.ROWWISE_ADAGRAD, Backend.FBGEMM),
        ("cpu", "avx512_bf16", True, EmbeddingOptimizer.ADAGRAD, Backend.FBGEMM),
        ("cpu", "DEFAULT", True, EmbeddingOptimizer.SGD, Backend.TORCH),
        ("cuda", "AVX2", True, EmbeddingOptimizer.ROWWISE_ADAGRAD, Backend.FBGEMM),
        ("cuda", "AVX512", False, EmbeddingOptimizer.ROWWISE_ADAGRAD, Backend.TORCH),
        ("cpu", "AVX512", True, EmbeddingOptimizer.CF_SGD, Backend.TORCH),
    ],
)
def test_auto_backend_rule(device, capability, installed, optimizer, expected):
    assert auto_backend(device, capability, installed, optimizer) is expected


def test_auto_backend_keeps_tables_fbgemm_cannot_align_on_the_torch_kernel():
    rowwise = EmbeddingOptimizer.ROWWISE_ADAGRAD
    assert auto_backend("cpu", "AVX512", True, rowwise, [8, 16]) is Backend.FBGEMM
    assert auto_backend("cpu", "AVX512", True, rowwise, [8, 2]) is Backend.TORCH
    assert auto_backend("cuda", "AVX2", True, rowwise, [6]) is Backend.TORCH


def test_auto_resolves_by_this_machines_capability():
    capability = torch.backends.cpu.get_cpu_capability()
    expected = auto_backend("cpu", capability, fbgemm_available())
    assert resolve_backend("auto", torch.device("cpu")) is expected
    assert EmbeddingBagCollection([TableConfig("t", 4, 8)]).backend is expected
    # A dimension FBGEMM cannot align trains on the torch kernel on any machine.
    assert EmbeddingBagCollection([TableConfig("t", 4, 2)]).backend is Backend.TORCH


def test_dense_optimizers_are_fused_on_cpu():
    from towerrec.build.optimizers import build_dense_optimizer
    from towerrec.config import OptimizerConfig

    model = tiny_dlrm()
    for name in ("adam", "adagrad", "sgd"):
        optimizer = build_dense_optimizer(OptimizerConfig(name=name), model)
        assert optimizer.defaults["fused"] is True, name
        # the embedding tables stay with their fused in-backward optimizer
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        assert params == {id(p) for p in model.parameters()}


def test_bench_train_reports_wall_and_cpu_ratios_side_by_side():
    from towerrec.bench.roofline import layer_matmul_seconds, measure_roofline
    from towerrec.bench.train import run_train_benchmark

    shape = {
        "num_dense": 13,
        "num_tables": 3,
        "num_embeddings": 50,
        "embedding_dim": 8,
        "bottom_mlp": [16, 8],
        "top_mlp": [8, 1],
    }
    result = run_train_benchmark(
        steps=2,
        warmup=1,
        backends="torch",
        batch_size=32,
        shape=shape,
        rounds=2,
        threads=1,
        measure=lambda dtype, clock: measure_roofline("cpu", dtype, 0.05, clock),  # short
        measure_matmuls=lambda layers, batch, dtype: layer_matmul_seconds(
            layers, batch, dtype, seconds=0.05
        ),
    )
    ours = result["results"]["towerrec_torch"]
    assert ours["samples_per_s"] > 0 and ours["cpu_ms_per_step"] > 0
    assert ours["cpu_roofline_fraction"] > 0 and ours["roofline_fraction"] > 0
    assert ours["shapes_bound_fraction"] > 0 and ours["shapes_matmul_ms"] > 0
    if "samples_per_s" in result["results"].get("torchrec", {}):
        # TorchRec both ways (under DMP and its fused collection alone); ratios against
        # the faster of the two
        trec = {n: result["results"][n]["samples_per_s"] for n in ("torchrec", "torchrec_no_dmp")}
        reference = result["torchrec_reference"]
        assert trec[reference] == max(trec.values())
        assert f"towerrec_torch/{reference}" in result["ratios"]
        cpu = {n: result["results"][n]["cpu_ms_per_step"] for n in ("torchrec", "torchrec_no_dmp")}
        assert cpu[result["cpu_torchrec_reference"]] == min(cpu.values())
        assert f"towerrec_torch/{result['cpu_torchrec_reference']}" in result["cpu_ratios"]
    # the default row: auto resolved by the rule (the suite sets TOWERREC_MEASURE=0)
    default = result["results"][result["default_row"]]
    assert default["backend"] == resolve_backend("auto", torch.device("cpu")).value


@pytest.mark.multiprocess
def test_bench_dist_dlrm_times_every_system_on_two_ranks():
    from towerrec.bench.dist_train import DIST_DLRM_SHAPE, run_dist_train_benchmark

    shape = dict(DIST_DLRM_SHAPE, num_tables=3, num_embeddings=100, batch_per_rank=16)
    result = run_dist_train_benchmark((2,), ("table_wise",), steps=1, rounds=1, shape=shape)
    results = result["worlds"]["2x1"]["results"]
    expected = {"towerrec_table_wise", "towerrec_table_wise_pipelined_fp16"}
    if result["torchrec"] is True:
        expected.add("torchrec_table_wise")
    assert set(results) == expected
    assert all(r["samples_per_s"] > 0 for r in results.values())


def test_bench_train_refuses_zero_threads():
    result = run_cli("bench", "train", "--threads", "0", "--no-torchrec")
    assert result.returncode == 2
    assert "error: --threads must be >= 1, got 0" in result.stderr


@needs_torchrec
def test_torchrec_without_dmp_trains_its_tables_and_dense_layers():
    """The no-DMP TorchRec reference is real training: a step moves its embedding rows
    (row-wise Adagrad in the backward) and its dense weights (Adam)."""
    from towerrec.bench.torchrec_ref import torchrec_dlrm_fused, torchrec_step
    from towerrec.bench.train import make_batches

    shape = {
        "num_dense": 4,
        "num_tables": 2,
        "num_embeddings": 20,
        "embedding_dim": 8,
        "bottom_mlp": [8, 8],
        "top_mlp": [8, 1],
    }
    model, optimizer = torchrec_dlrm_fused(2, 20, 8, 4, [8, 8], [8, 1], 0.1, 0.01)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = make_batches(shape, 16, count=1)[0]
    torchrec_step(model, optimizer, (batch.dense, batch.sparse.to_torchrec(), batch.labels))
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("embedding_bags" in k for k in changed), changed
    assert any("embedding_bags" not in k for k in changed), changed
