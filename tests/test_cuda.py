"""The same code on a CUDA device: skipped where no GPU is present (CI has none).

Each check compares the CUDA run with the CPU run of the same model and data.
"""

import json

import pytest
import torch
from test_embedding import TABLES, random_batch, train_steps

from towerrec.config import load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train import trainer
from towerrec.train.build import build_dense_optimizer, build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
            float(trainer.train_step(model, optimizer, next(batches).to(device))) for _ in range(5)
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
