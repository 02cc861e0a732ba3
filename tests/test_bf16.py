import pytest
import torch

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import ConfigError, load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.modules.embedding_bag import dense_parameters
from towerrec.train import step
from towerrec.workflows import training as trainer

QUICK = ["train.progress=false", "train.eval_every=0"]


@pytest.mark.parametrize("name", ["dlrm", "dcn", "wukong"])
def test_bf16_step_keeps_fp32_master_weights(name):
    config = load_config("configs/quick.toml", [*QUICK, f"model.name={name}"])
    source = SyntheticSource(config.data.synthetic)
    model = build_model(config, source.schema, torch.device("cpu"))
    optimizer = build_dense_optimizer(config.optimizer, model)
    batch = next(source.train_batches(64))
    with torch.no_grad():
        fp32 = model(batch.dense, batch.sparse)
        with step.autocast(torch.device("cpu"), torch.bfloat16):
            bf16 = model(batch.dense, batch.sparse)
    assert bf16.dtype == torch.bfloat16  # the dense part did run in bf16
    assert not torch.equal(bf16.float(), fp32)
    torch.testing.assert_close(bf16.float(), fp32, rtol=0.05, atol=0.05)
    before = {n: p.detach().clone() for n, p in dense_parameters(model)}
    loss = step.train_step(model, optimizer, batch, torch.bfloat16)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    for n, p in dense_parameters(model):
        assert p.dtype == torch.float32, n
    assert any(not torch.equal(p, before[n]) for n, p in dense_parameters(model))


@pytest.mark.slow  # bf16 matmuls are slow on CPUs without AVX-512 BF16 / AMX
def test_bf16_training_reaches_the_fp32_auc(tmp_path):
    runs = {
        precision: trainer.train(
            load_config(
                "configs/quick.toml",
                [*QUICK, "train.steps=40", "train.threads=1", f"train.precision={precision}"],
            ),
            tmp_path / precision,
        )
        for precision in ("fp32", "bf16")
    }
    assert runs["bf16"]["precision"] == "bf16"
    assert runs["bf16"]["auc"] > 0.55
    assert abs(runs["bf16"]["auc"] - runs["fp32"]["auc"]) < 0.02


def test_precision_config_error():
    with pytest.raises(
        ConfigError, match=r"train\.precision = 'fp16' is not one of 'fp32', 'bf16', 'auto'"
    ):
        load_config(None, ["train.precision=fp16"])
