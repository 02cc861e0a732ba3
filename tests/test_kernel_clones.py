"""The native extension's instruction-set clones give the same bits: ``_fused.c`` built
for AVX2 alone and for the compiler's baseline (``tools/kernel_clones.py``, as a CPU
without AVX-512 runs it) against the installed build, forward and backward of the dots
and of the top MLP's joined input, the pooled lookup, row-wise Adagrad's statistics and
the ReLU's gradient. Each clone runs on this CPU; the AVX-512 clone is the installed one
wherever the CPU has AVX-512. Each at every width of the dots' kernels (16, 8 and 4
lanes)."""

import importlib.util
import shutil
import sys

import pytest
import torch
from conftest import ROOT

from towerrec.hardware import cpu_flags
from towerrec.modules.native import fused

pytestmark = [
    pytest.mark.skipif(fused is None, reason="the native extension _fused is not built here"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the clones"),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or "avx2" not in cpu_flags(),
        reason="x86 with AVX2: the clones are built for it",
    ),
]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("kernel_clones", ROOT / "tools/kernel_clones.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outputs(module, lanes: int) -> list[torch.Tensor]:
    """Every kernel's results on fixed inputs at the dots' width ``lanes``, as int32 views
    (signed zeros count)."""
    module.vector_lanes(lanes)
    torch.manual_seed(0)
    batch, tables, dim = 19, 26, 16
    features = tables + 1
    rows, cols = torch.triu_indices(features, features, offset=1)
    pairs = rows.numel()
    r, c = rows.numpy(), cols.numpy()
    x = torch.randn(batch, features, dim) * torch.logspace(-3, 3, dim)
    x[x.abs() < 0.05] = 0.0
    grad = torch.randn(batch, pairs)
    dots, gx = torch.empty(batch, pairs), torch.empty(batch, features, dim)
    module.forward(x.numpy(), r, c, dots.numpy(), batch, features, dim, pairs, 2)
    module.backward(x.numpy(), r, c, grad.numpy(), gx.numpy(), batch, features, dim, pairs, 2)
    width = dim + pairs + 1
    bottom, pooled = x[:, 0].contiguous(), x[:, 1:].reshape(batch, -1).contiguous()
    joined, upstream = torch.empty(batch, width), torch.randn(batch, width)
    g_bottom, g_pooled = torch.empty(batch, dim), torch.empty(batch, tables * dim)
    args = (bottom.numpy(), pooled.numpy(), r, c)
    module.concat_forward(*args, joined.numpy(), batch, tables, dim, pairs, width, False, 2)
    module.concat_backward(
        *args, upstream.numpy(), g_bottom.numpy(), g_pooled.numpy(),
        batch, tables, dim, pairs, width, False, 2,
    )  # fmt: skip
    weight = torch.randn(tables * 50, dim)
    ids = (torch.randint(0, 50, (tables, batch)) + torch.arange(tables)[:, None] * 50).flatten()
    offsets = torch.arange(tables * batch + 1)
    pooled_out = torch.empty(batch, tables * dim)
    module.bag_sum(
        weight.numpy(), ids.numpy(), offsets.numpy(), pooled_out.numpy(), None, True,
        tables, batch, dim, tables * 50,
    )  # fmt: skip
    sums, state = torch.randn(batch * tables, dim) * 30, torch.rand(batch * tables)
    module.row_statistics(sums.numpy(), state.numpy(), batch * tables, dim)
    relu_out = torch.randn(batch, 300)
    relu_out[relu_out.abs() < 0.05] = -0.0
    relu_in = torch.randn(batch, 300).bfloat16().view(torch.int16)
    half_out, half_grad = relu_out.bfloat16().view(torch.int16), torch.empty_like(relu_in)
    module.relu_grad(relu_in.numpy(), half_out.numpy(), half_grad.numpy(), batch * 300)
    results = (dots, gx, joined, g_bottom, g_pooled, pooled_out, state, half_grad)
    return [t.contiguous().view(torch.int32) for t in results]


@pytest.mark.parametrize("target", ["avx2", "default"])
def test_each_clone_gives_the_installed_builds_bits(tool, tmp_path, target):
    """Each clone at every width of the dots' kernels, the one its CPUs get included."""
    clone = tool.build(tool.current_source(), target, tmp_path / target)
    assert clone.vector_lanes() == tool.TARGET_LANES[target]
    lanes = fused.vector_lanes()
    try:
        expected = outputs(fused, lanes)
        for width in (16, 8, 4):
            for a, b in zip(expected, outputs(clone, width)):
                assert torch.equal(a, b)
    finally:
        fused.vector_lanes(lanes)
