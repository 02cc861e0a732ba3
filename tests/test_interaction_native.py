"""The fused CPU pairwise dot interaction (``modules/_fused.c``) against a float64
reference, against the batched-matmul path it replaces, and its argument checks."""

import itertools

import pytest
import torch

from towerrec.modules import interaction
from towerrec.modules.interaction import DotInteraction, native_dots_available

pytestmark = pytest.mark.skipif(
    not native_dots_available(), reason="the native extension _fused is not built here"
)


def reference(x: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    """Each pair's dot product in float64, pairs in row-major order."""
    f = x.shape[1]
    pairs = (
        itertools.combinations_with_replacement(range(f), 2)
        if self_interaction
        else itertools.combinations(range(f), 2)
    )
    x = x.double()
    return torch.stack([(x[:, i] * x[:, j]).sum(1) for i, j in pairs], dim=1)


@pytest.mark.parametrize(
    ("batch", "features", "dim", "self_interaction"),
    [
        (7, 10, 16, False),  # the default model: 45 pairs, a short last group of 13
        (5, 2, 16, False),  # one pair
        (9, 17, 48, False),  # 136 pairs (8 groups of 16 and 8), three vectors a row
        (6, 5, 32, True),  # self pairs: d(x.x)/dx = 2x
        (1024, 27, 16, False),  # the Criteo shape, large enough to run on two threads
        (512, 27, 64, False),  # above dim 16: S X with the rows in registers, two threads
        (5, 6, 80, True),  # four lane groups and one more, self pairs
    ],
)
def test_native_dots_match_float64_reference(batch, features, dim, self_interaction):
    torch.manual_seed(0)
    x = torch.randn(batch, features, dim, requires_grad=True)
    module = DotInteraction(features, self_interaction)
    out = module(x)
    assert "NativePairwiseDots" in type(out.grad_fn).__name__
    x64 = x.detach().double().requires_grad_()
    expected = reference(x64, self_interaction)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    (ours,) = torch.autograd.grad(out, x, grad)
    (theirs,) = torch.autograd.grad(expected, x64, grad.double())
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)


def test_native_dots_match_the_batched_matmul_path(monkeypatch):
    torch.manual_seed(1)
    x = torch.randn(64, 10, 16, requires_grad=True)
    module = DotInteraction(10)
    grad = torch.randn(64, module.out_features)
    native = module(x)
    (native_grad,) = torch.autograd.grad(native, x, grad)
    monkeypatch.setattr(interaction, "_native", None)
    matmul = module(x)
    assert "NativePairwiseDots" not in type(matmul.grad_fn).__name__
    (matmul_grad,) = torch.autograd.grad(matmul, x, grad)
    torch.testing.assert_close(native, matmul)
    torch.testing.assert_close(native_grad, matmul_grad)


@pytest.mark.parametrize("dim", [16, 64])
def test_native_dots_do_not_depend_on_the_thread_count(dim):
    """Threads split the batch; each sample's sums run in the same order on any split."""
    torch.manual_seed(2)
    x = torch.randn(2048, 27, dim, requires_grad=True)
    module = DotInteraction(27)
    grad = torch.randn(2048, module.out_features)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            out = module(x)
            results.append((out, *torch.autograd.grad(out, x, grad)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def pair_by_pair_gradient(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The backward's sums for the module's pairs (the upper triangle, row-major) in the
    extension's order, in float32: row i's own sum (its pairs (i, j), j ascending) added
    after the terms of the pairs (r, i), r ascending, each product rounded, then added."""
    batch, features, dim = x.shape
    t = torch.zeros_like(x)
    p = 0
    for i in range(features - 1):
        a = torch.zeros(batch, dim)
        for j in range(i + 1, features):
            w = grad[:, p : p + 1]
            a = a + w * x[:, j]
            t[:, j] = t[:, j] + w * x[:, i]
            p += 1
        t[:, i] = t[:, i] + a
    return t


@pytest.mark.parametrize("features", [2, 5, 6, 10, 27, 31])
def test_native_backward_of_the_module_pairs_keeps_the_pair_by_pair_sums(features):
    """At dim 16 the module's pairs take rows four at a time (sample_grad_triu): the
    same additions in the same order as pair by pair, so the same bits, signed zeros
    included (the int32 views compared)."""
    torch.manual_seed(features)
    batch = 33
    x = torch.randn(batch, features, 16) * torch.logspace(-4, 4, 16)
    x[x.abs() < 0.2] = 0.0
    x[0] = -0.0
    module = DotInteraction(features)
    grad = torch.randn(batch, module.out_features)
    grad[:, ::5] = -0.0
    gx = torch.full_like(x, float("nan"))
    interaction._native.backward(
        x.numpy(), module.pair_rows.numpy(), module.pair_cols.numpy(), grad.numpy(),
        gx.numpy(), batch, features, 16, module.out_features, 2,
    )  # fmt: skip
    expected = pair_by_pair_gradient(x, grad)
    assert torch.equal(gx.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dim", [16, 48])
@pytest.mark.parametrize("order", ["shuffled", "repeated", "two swapped"])
def test_native_backward_takes_pairs_in_any_order_and_repeated(dim, order):
    """The extension's backward for any list of pairs (the module lists each once, in
    row-major order): shuffled, with a self pair, with pairs listed twice, whose
    gradients add up, or the module's pairs with two of them swapped (not taken for the
    module's own list)."""
    torch.manual_seed(3)
    batch, features = 9, 6
    if order == "two swapped":
        pairs = list(itertools.combinations(range(features), 2))
        pairs[3], pairs[4] = pairs[4], pairs[3]
    else:
        pairs = list(itertools.combinations_with_replacement(range(features), 2))
        pairs = [pairs[k] for k in torch.randperm(len(pairs)).tolist()]
    if order == "repeated":
        pairs += pairs[:4]
    rows = torch.tensor([i for i, _ in pairs])
    cols = torch.tensor([j for _, j in pairs])
    x = torch.randn(batch, features, dim)
    grad = torch.randn(batch, len(pairs))
    gx = torch.full_like(x, float("nan"))  # every entry written
    interaction._native.backward(
        x.numpy(), rows.numpy(), cols.numpy(), grad.numpy(), gx.numpy(),
        batch, features, dim, len(pairs), 2,
    )  # fmt: skip
    x64 = x.double().requires_grad_()
    dots = torch.stack([(x64[:, i] * x64[:, j]).sum(1) for i, j in pairs], dim=1)
    (expected,) = torch.autograd.grad(dots, x64, grad.double())
    torch.testing.assert_close(gx.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dim", "dtype"), [(8, torch.float32), (16, torch.float64)])
def test_other_dims_and_dtypes_take_the_batched_matmuls(dim, dtype):
    x = torch.randn(3, 4, dim, dtype=dtype)
    out = DotInteraction(4)(x.requires_grad_())
    assert "NativePairwiseDots" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out.double(), reference(x, False), rtol=1e-5, atol=1e-5)


def test_extension_refuses_mismatched_arguments():
    native = interaction._native
    x = torch.randn(2, 3, 16)
    rows, cols = torch.triu_indices(3, 3, offset=1)
    out = torch.empty(2, 3)
    arrays = (x.numpy(), rows.numpy(), cols.numpy())
    with pytest.raises(ValueError, match="out holds"):
        native.forward(*arrays, torch.empty(2, 2).numpy(), 2, 3, 16, 3, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        native.forward(*arrays, out.numpy(), 2, 3, 12, 3, 1)
    bad = torch.tensor([0, 0, 3])
    with pytest.raises(ValueError, match="outside"):
        native.forward(x.numpy(), bad.numpy(), cols.numpy(), out.numpy(), 2, 3, 16, 3, 1)
    with pytest.raises(ValueError, match="gx holds"):
        native.backward(*arrays, out.numpy(), torch.empty(2, 3).numpy(), 2, 3, 16, 3, 1)


def test_export_traces_the_batched_matmuls():
    """An exported model holds torch operators only: export takes the matmul path."""
    x = torch.randn(4, 10, 16)
    module = DotInteraction(10)
    exported = torch.export.export(module, (x,))
    targets = {str(node.target) for node in exported.graph.nodes}
    assert any("bmm" in t for t in targets), targets
    torch.testing.assert_close(exported.module()(x), module(x))


@pytest.fixture
def vector_width():
    """Restores the extension's width of the dots' kernels after a test."""
    lanes = interaction._native.vector_lanes()
    yield interaction._native.vector_lanes
    interaction._native.vector_lanes(lanes)


WIDTHS = (16, 8, 4)


@pytest.mark.parametrize("dim", [16, 32, 48, 64, 80])
@pytest.mark.parametrize("pairs", ["module", "self", "shuffled", "repeated"])
def test_every_width_gives_the_bits_of_the_16_lane_kernels(vector_width, dim, pairs):
    """Without AVX-512 the dots take rows of 8 lanes, or of 4 on 128-bit vectors
    (``_fused.c``, the note at ``v8``): the same sums in the same order, so the same bits,
    signed zeros included, forward and backward, for every kind of pair list; here every
    width runs on this CPU."""
    torch.manual_seed(dim)
    batch, features = 37, 11
    rows, cols = torch.triu_indices(features, features, offset=0 if pairs == "self" else 1)
    if pairs in ("shuffled", "repeated"):
        order = torch.randperm(rows.numel())
        rows, cols = rows[order], cols[order]
    if pairs == "repeated":
        rows, cols = torch.cat([rows, rows[:3]]), torch.cat([cols, cols[:3]])
    rows, cols, count = rows.contiguous(), cols.contiguous(), rows.numel()
    x = torch.randn(batch, features, dim) * torch.logspace(-3, 3, dim)
    x[x.abs() < 0.05] = 0.0
    x[0] = -0.0
    grad = torch.randn(batch, count)
    grad[:, ::5] = -0.0
    results = []
    for lanes in WIDTHS:
        vector_width(lanes)
        out = torch.full((batch, count), float("nan"))
        gx = torch.full_like(x, float("nan"))
        args = (x.numpy(), rows.numpy(), cols.numpy())
        interaction._native.forward(*args, out.numpy(), batch, features, dim, count, 2)
        interaction._native.backward(
            *args, grad.numpy(), gx.numpy(), batch, features, dim, count, 2
        )
        results.append(torch.cat([out.flatten(), gx.flatten()]).view(torch.int32))
    for other in results[1:]:
        assert torch.equal(results[0], other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_kernels_give_the_same_bits_at_every_width(vector_width, dtype):
    """The top MLP's input and both its gradients, as the model trains with them, at each
    width of the dots' kernels."""
    torch.manual_seed(5)
    module = DotInteraction(27)
    x = torch.randn(256, 16)
    embeddings = torch.randn(256, 26 * 16)
    upstream = torch.randn(256, 16 + module.out_features + 1)
    results = []
    for lanes in WIDTHS:
        vector_width(lanes)
        xs = x.to(dtype).requires_grad_()
        es = embeddings.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = module.joined(xs, es, 1)
        assert out is not None
        grads = torch.autograd.grad(out, (xs, es), upstream.to(out.dtype))
        results.append([out.detach().float(), *(g.float() for g in grads)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_vector_lanes_takes_only_the_built_widths(vector_width):
    """A width the kernels are not built for is refused, and the setting kept."""
    before = vector_width()
    with pytest.raises(ValueError, match="16, 8 or 4"):
        vector_width(2)
    assert vector_width() == before
