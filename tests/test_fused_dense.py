"""The dense part's one-call paths on the CPU: DLRM's top MLP input built in one native
call each way (``DotInteraction.joined``, ``_fused.c``: concat_forward and
concat_backward) and a plain MLP's layers as one autograd node (``mlp._LayerStack``).
Each is checked bit for bit against the path it replaces (the stacked interaction and
concatenation; the layer-by-layer MLP), in float32 and under bfloat16 autocast."""

import itertools

import pytest
import torch
from torch import nn

from towerrec.models.dlrm import DLRM
from towerrec.modules import interaction
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.interaction import DotInteraction, native_dots_available
from towerrec.modules.mlp import MLP
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor

native = pytest.mark.skipif(
    not native_dots_available(), reason="the native extension _fused is not built here"
)

TABLES = 5


def dlrm(seed: int = 0, dim: int = 16, padded: bool = True) -> DLRM:
    torch.manual_seed(seed)
    tables = [TableConfig(f"t{i}", 50, dim) for i in range(TABLES)]
    ebc = EmbeddingBagCollection(tables, backend="torch")
    # 6 vectors: 15 pairs; dim + 15 = 31 inputs (below 64: no padding), or 79 with dim 64
    top = [32, 1]
    model = DLRM(ebc, num_dense=13, bottom_mlp=[24, dim], top_mlp=top)
    assert (model.top.input_padding > 0) == padded
    return model


def batch(size: int = 33, seed: int = 1) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (TABLES * size,), generator=gen)
    sparse = KeyedJaggedTensor(
        [f"t{i}" for i in range(TABLES)],
        torch.randint(0, 50, (int(lengths.sum()),), generator=gen),
        lengths,
    )
    return torch.randn(size, 13, generator=gen), sparse


def train_once(model: DLRM, dtype: torch.dtype | None, steps: int = 2) -> dict:
    """Logits of the last step, and the state (dense weights after an Adam step, tables
    after their fused row-wise Adagrad) after ``steps`` steps."""
    optimizer = torch.optim.Adam(
        [p for n, p in model.named_parameters() if not n.startswith("sparse")], lr=0.01
    )
    for step in range(steps):
        dense, sparse = batch(seed=step)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(dense, sparse)
        labels = torch.arange(logits.numel()) % 2
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"logits": logits.detach(), **model.state_dict()}


def stacked_path(monkeypatch) -> None:
    monkeypatch.setattr(DotInteraction, "joined", lambda self, *args: None)


@native
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64])
def test_joined_input_trains_bit_for_bit_like_the_stacked_path(monkeypatch, dtype, dim):
    calls = []
    apply = interaction._NativeJoined.apply
    monkeypatch.setattr(interaction._NativeJoined, "apply", lambda *a: calls.append(1) or apply(*a))
    ours = train_once(dlrm(dim=dim, padded=dim == 64), dtype)
    assert len(calls) == 2  # one call a step: the joined path ran
    stacked_path(monkeypatch)
    theirs = train_once(dlrm(dim=dim, padded=dim == 64), dtype)
    assert len(calls) == 2
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert ours["logits"].dtype == (dtype or torch.float32)


@native
def test_joined_input_matches_a_float64_reference_with_its_zero_columns():
    torch.manual_seed(0)
    module = DotInteraction(TABLES + 1)
    x = torch.randn(40, 16, requires_grad=True)
    e = torch.randn(40, TABLES * 16, requires_grad=True)
    out = module.joined(x, e, 3)
    assert out is not None and out.shape == (40, 16 + 15 + 3)
    x64, e64 = x.detach().double().requires_grad_(), e.detach().double().requires_grad_()
    stacked = torch.cat([x64.unsqueeze(1), e64.view(40, TABLES, 16)], 1)
    pairs = itertools.combinations(range(TABLES + 1), 2)
    dots = torch.stack([(stacked[:, i] * stacked[:, j]).sum(1) for i, j in pairs], 1)
    expected = torch.cat([x64, dots, x64.new_zeros(40, 3)], 1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(40, out.shape[1])
    ours = torch.autograd.grad(out, (x, e), grad)
    theirs = torch.autograd.grad(expected, (x64, e64), grad.double())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@native
def test_joined_input_rounds_to_bfloat16_as_torch_does():
    """Dots of every magnitude, ties, infinities and NaN rounded as torch's cast rounds
    them, and x's two gradients added in bfloat16 as autograd adds them."""
    torch.manual_seed(1)
    module = DotInteraction(TABLES + 1)
    x = (torch.randn(64, 16) * torch.logspace(-20, 20, 64).unsqueeze(1)).bfloat16()
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("nan"), -float("inf")
    e = torch.randn(64, TABLES * 16) * torch.logspace(-15, 15, 64).unsqueeze(1)
    grad = (torch.randn(64, 16 + 15 + 1) * 1e3).bfloat16()
    results = []
    for joined in (True, False):
        xi, ei = x.clone().requires_grad_(), e.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if joined:
                out = module.joined(xi, ei, 1)
                assert out is not None
            else:
                dots = module(torch.cat([xi.unsqueeze(1), ei.view(64, TABLES, 16)], 1))
                out = torch.cat([xi, dots, dots.new_zeros(64, 1)], 1)
        results.append((out, *torch.autograd.grad(out, (xi, ei), grad)))
    assert results[0][0].isnan().any() and results[0][0].isinf().any()
    for ours, theirs in zip(*results):  # the same values; a NaN's sign bit aside
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


@native
def test_joined_input_does_not_depend_on_the_thread_count():
    torch.manual_seed(2)
    module = DotInteraction(27)
    x = torch.randn(2048, 16, requires_grad=True)
    e = torch.randn(2048, 26 * 16, requires_grad=True)
    grad = torch.randn(2048, 16 + module.out_features + 1)
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            out = module.joined(x, e, 1)
            results.append((out, *torch.autograd.grad(out, (x, e), grad)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@native
def test_joined_input_declines_what_it_does_not_compute_as_the_stacked_path():
    module = DotInteraction(TABLES + 1)
    x, e = torch.randn(4, 16), torch.randn(4, TABLES * 16)
    assert module.joined(x, e.double(), 0) is None  # embeddings not float32
    assert module.joined(x[:, :8], e[:, : TABLES * 8], 0) is None  # dim 8
    assert module.joined(x, e[:, :16], 0) is None  # not TABLES tables
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module.joined(x, e, 0) is None  # float32 x under bfloat16 autocast
    with torch.autocast("cpu", dtype=torch.float16):
        assert module.joined(x.half(), e, 0) is None  # float16: the stacked path
    assert module.joined(x.bfloat16(), e, 0) is None  # bfloat16 x without autocast


@native
def test_concat_extension_refuses_mismatched_arguments():
    rows, cols = torch.triu_indices(TABLES + 1, TABLES + 1, offset=1)
    x, e = torch.randn(2, 16), torch.randn(2, TABLES * 16)
    args = (x.numpy(), e.numpy(), rows.numpy(), cols.numpy())
    native_module = interaction._native
    with pytest.raises(ValueError, match="width 20 is less than"):
        native_module.concat_forward(
            *args, torch.empty(2, 20).numpy(), 2, TABLES, 16, 15, 20, False, 1
        )
    with pytest.raises(ValueError, match="out holds"):
        native_module.concat_forward(
            *args, torch.empty(2, 30).numpy(), 2, TABLES, 16, 15, 31, False, 1
        )
    with pytest.raises(ValueError, match="x holds"):
        native_module.concat_forward(
            *args, torch.empty(2, 31).numpy(), 2, TABLES, 16, 15, 31, True, 1
        )
    with pytest.raises(ValueError, match="ge holds"):
        native_module.concat_backward(
            *args, torch.empty(2, 31).numpy(), torch.empty(2, 16).numpy(),
            torch.empty(2, 16).numpy(), 2, TABLES, 16, 15, 31, False, 1,
        )  # fmt: skip


def mlp_run(mlp: MLP, x: torch.Tensor, dtype: torch.dtype | None) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_(x.requires_grad)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = mlp(xi)
    grad = torch.linspace(-1, 1, out.numel()).view_as(out)
    inputs = [xi, *mlp.parameters()] if x.requires_grad else list(mlp.parameters())
    return [out.detach(), *torch.autograd.grad(out, inputs, grad.to(out.dtype))]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize(
    ("in_features", "sizes", "final", "padded_input", "input_grad"),
    [
        (13, [64, 32, 16], True, False, False),  # a bottom MLP: no input gradient
        (367, [64, 1], False, True, True),  # a top MLP on its zero-padded input
        (367, [64, 1], False, False, True),  # the same input, padded in the layer
        (100, [100, 70, 9], True, False, True),  # padding between layers
    ],
)
def test_layer_stack_matches_the_layer_by_layer_path_bit_for_bit(
    monkeypatch, dtype, in_features, sizes, final, padded_input, input_grad
):
    torch.manual_seed(0)
    mlp = MLP(in_features, sizes, final_activation=final)
    width = in_features + (mlp.input_padding if padded_input else 0)
    x = torch.randn(48, width)
    x[:, in_features:] = 0
    x.requires_grad_(input_grad)
    nodes = []
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        nodes.append(type(mlp(x).grad_fn).__name__)
    assert "LayerStack" in nodes[0]
    ours = mlp_run(mlp, x, dtype)
    monkeypatch.setattr(MLP, "_stack_plan", lambda self, x: None)
    theirs = mlp_run(mlp, x, dtype)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [{"dropout": 0.5}, {"batch_norm": True}],
)
def test_layer_stack_leaves_dropout_and_batch_norm_to_the_layers(kwargs):
    mlp = MLP(8, [4, 2], **kwargs)
    out = mlp(torch.randn(5, 8, requires_grad=True))
    assert "LayerStack" not in type(out.grad_fn).__name__


def test_exported_mlp_holds_torch_operators():
    mlp = MLP(13, [16, 4])
    x = torch.randn(3, 13)
    exported = torch.export.export(mlp, (x,))
    targets = {str(node.target) for node in exported.graph.nodes}
    assert any("addmm" in t or "linear" in t for t in targets), targets
    torch.testing.assert_close(exported.module()(x), mlp(x))


def test_relu_backward_gives_threshold_backwards_bits():
    """The native ReLU gradient (``_fused.c``: relu_grad) on bfloat16 against ATen's
    threshold_backward, signed zeros, infinities, NaNs of both signs and subnormals
    included, on a size that splits between threads at no multiple of 64 (and float32,
    which keeps ATen's)."""
    from towerrec.modules import mlp as mlp_module
    from towerrec.modules.native import fused

    if fused is None:
        pytest.skip("the native extension _fused is not built here")
    gen = torch.Generator().manual_seed(3)
    for dtype, width in itertools.product((torch.bfloat16, torch.float32), (1, 37, 512)):
        out = torch.randn(300, width, generator=gen).to(dtype)
        grad = torch.randn(300, width, generator=gen).to(dtype)
        special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-40]
        flat = out.view(-1)
        flat[: len(special)] = torch.tensor(special[: flat.numel()]).to(dtype)
        expected = torch.ops.aten.threshold_backward(grad, out, 0)
        got = mlp_module.relu_backward(grad, out)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), expected.view(bits)), (dtype, width)
        assert got.data_ptr() != grad.data_ptr()  # the incoming gradient is left alone
    with pytest.raises(ValueError, match="dst holds"):
        g = torch.zeros(4, dtype=torch.bfloat16)
        fused.relu_grad(g.view(torch.int16).numpy(), g.view(torch.int16).numpy(),
                        g[:3].view(torch.int16).numpy(), 4)  # fmt: skip


def test_fused_relu_linear_is_taken_only_where_the_first_call_finds_the_same_bits(monkeypatch):
    """The bfloat16 layer with its ReLU fused into one oneDNN call: checked against
    ``addmm`` and ``relu_`` on each shape's first call, taken after where they agree, and
    never for a shape where they do not."""
    from towerrec.modules import mlp as mlp_module

    if not mlp_module._fused_relu_available():
        pytest.skip("this torch build has no oneDNN")
    try:
        mlp_module._pointwise_relu(*(torch.ones(2, 2, dtype=torch.bfloat16),) * 2 + (None,))
    except RuntimeError:
        pytest.skip("oneDNN has no bfloat16 linear for this CPU (no AVX-512)")
    monkeypatch.setattr(mlp_module, "_FUSED_RELU_BITS", {})
    calls = []
    real = mlp_module._pointwise_relu

    def counted(h, weight, bias):
        calls.append(h.shape)
        return real(h, weight, bias)

    monkeypatch.setattr(mlp_module, "_pointwise_relu", counted)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(64, 40, generator=gen).bfloat16()
    weight, bias = torch.randn(24, 40, generator=gen).bfloat16(), torch.randn(24).bfloat16()
    expected = torch.relu(torch.addmm(bias, h, weight.t()))
    for _ in range(2):
        assert torch.equal(mlp_module.relu_linear(h, weight, bias), expected)
    assert len(calls) == 2 and mlp_module._FUSED_RELU_BITS == {(64, 24, 40): True}

    def off_by_one_ulp(h, weight, bias):
        out = real(h, weight, bias)
        return (out.view(torch.int16) + 1).view(torch.bfloat16)

    monkeypatch.setattr(mlp_module, "_pointwise_relu", off_by_one_ulp)
    other = torch.randn(32, 40, generator=gen).bfloat16()
    for _ in range(2):
        want = torch.relu(torch.addmm(bias, other, weight.t()))
        assert torch.equal(mlp_module.relu_linear(other, weight, bias), want)
    assert mlp_module._FUSED_RELU_BITS[(32, 24, 40)] is False


def test_relu_linear_takes_the_two_operators_where_onednn_refuses_bf16(monkeypatch):
    """Without AVX-512, oneDNN has no bfloat16 kernel for the fused call and raises: the
    layer takes ``addmm`` and ``relu_`` for that shape, on its first call and after."""
    from towerrec.modules import mlp as mlp_module

    if not mlp_module._fused_relu_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(mlp_module, "_FUSED_RELU_BITS", {})

    def refused(h, weight, bias):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(mlp_module, "_pointwise_relu", refused)
    gen = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(24, 40, generator=gen).bfloat16(), torch.randn(24).bfloat16()
    h = torch.randn(16, 40, generator=gen).bfloat16()
    for _ in range(2):
        want = torch.relu(torch.addmm(bias, h, weight.t()))
        assert torch.equal(mlp_module.relu_linear(h, weight, bias), want)
    assert mlp_module._FUSED_RELU_BITS == {(16, 24, 40): False}
