"""The registries that choose by name (sources, models, dense optimizers), build_run, and
the step hooks the training loop speaks to."""

import json
import re

import pytest
import torch
from test_trainer import quick_config

from towerrec.build.models import MODELS
from towerrec.build.optimizers import DENSE_OPTIMIZERS
from towerrec.build.run import build_run
from towerrec.config import ConfigError, load_config
from towerrec.data.registry import SOURCES
from towerrec.data.synthetic import SyntheticSource
from towerrec.models.interfaces import RecommendationModel, RepresentationModel
from towerrec.models.names import REPRESENTATION_MODELS, ModelName
from towerrec.optim.sampled import SampledOptimizer
from towerrec.train.hooks import StepHook, SummaryEntry
from towerrec.train.loop import BatchSteps, run
from towerrec.train.numerics import pinned
from towerrec.train.session import set_up

SMALL = [
    "data.synthetic.num_embeddings=[40, 30, 20, 10]",
    "data.synthetic.pooling_factors=[1, 1, 1, 1]",
    "data.synthetic.eval_samples=256",
    "train.batch_size=64",
    "train.progress=false",
    "embedding.backend=torch",
]


def _accepted(key: str) -> set[str]:
    """The names the config accepts for ``key``, as its error for an unknown one lists them."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"{key}=no-such-name"])
    listed = str(error.value).split("is not one of", 1)[1]
    return set(re.findall(r"'([^']+)'", listed))


def test_the_config_accepts_exactly_the_registered_names():
    assert _accepted("data.source") == set(SOURCES)
    assert _accepted("model.name") == set(MODELS) == {n.value for n in ModelName}
    assert _accepted("optimizer.name") == set(DENSE_OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_entry_builds_a_recommendation_model(name):
    partition = ['model.dmt.partition="contiguous"', "model.dmt.num_towers=2"]
    config = load_config(None, [*SMALL, f"model.name={name}", *partition])
    built = build_run(config, device=torch.device("cpu"))
    assert isinstance(built.model, RecommendationModel)
    assert isinstance(built.model, RepresentationModel) == (name in REPRESENTATION_MODELS)
    assert built.schema == SyntheticSource(config.data.synthetic).schema


def test_build_run_resolves_a_learned_partition_and_builds_the_optimizer_of_the_name():
    config = load_config(
        None,
        [*SMALL, "model.name=dmt", "model.dmt.num_towers=2", "model.dmt.pilot_steps=2"],
    )
    built = build_run(config, device=torch.device("cpu"))
    groups = built.config.model.dmt.partition
    assert config.model.dmt.partition == "auto" and not isinstance(groups, str)
    assert sorted(f for g in groups for f in g) == built.schema.sparse_names
    for name in ("sgd", "dance"):
        optimizer = build_run(load_config(None, [*SMALL, f"optimizer.name={name}"])).optimizer
        assert isinstance(optimizer, SampledOptimizer) == (name == "dance")


def test_every_source_entry_checks_its_section():
    for name in ("criteo", "cache"):
        with pytest.raises(ConfigError, match=r"needs data\.path"):
            load_config(None, [f"data.source={name}"])
    with pytest.raises(ConfigError, match=r"needs data\.augmented\.dir"):
        load_config(None, ["data.source=augmented"])
    assert [n for n, e in SOURCES.items() if e.endless] == ["synthetic"]
    assert [n for n, e in SOURCES.items() if not e.raw] == ["augmented"]
    data = load_config(None, []).data
    assert isinstance(SOURCES["synthetic"].build(data), SyntheticSource)


class Recorder(StepHook):
    """Every call the loop makes, in order."""

    def __init__(self):
        self.calls = []

    def setup(self, session):
        self.calls.append(("setup", session.steps))

    def on_restore(self, step):
        self.calls.append(("on_restore", step))

    def on_start(self, step):
        self.calls.append(("on_start", step))

    def before_step(self, step):
        self.calls.append(("before_step", step))

    def after_step(self, step, loss, rows):
        assert loss.dim() == 0 and not loss.requires_grad
        self.calls.append(("after_step", step, rows))

    def on_validation(self, step, metrics):
        self.calls.append(("on_validation", step))

    def on_step_end(self, step, stopping):
        self.calls.append(("on_step_end", step, stopping))

    def on_end(self, step):
        self.calls.append(("on_end", step))

    def on_summary(self, summary):
        self.calls.append(("on_summary", summary["steps"]))
        summary["recorded"] = len(self.calls)


def test_the_loop_calls_its_hooks_in_order_and_a_resume_restores_through_them(tmp_path):
    config = quick_config("train.steps=4", "train.eval_every=2", "train.log_every=2")
    first = Recorder()
    with pinned():
        session = set_up(config, tmp_path, False, hooks=[first])
        summary = run(session, BatchSteps(), stop_after=3)
    rows = 256
    assert first.calls == [
        ("setup", 4),
        ("on_start", 0),
        *[
            call
            for step in (1, 2, 3)
            for call in (
                ("before_step", step),
                ("after_step", step, rows),
                *([("on_validation", step)] if step == 2 else []),
                ("on_step_end", step, step == 3),
            )
        ],
        ("on_end", 3),
        ("on_summary", 3),
    ]
    assert summary["recorded"] == len(first.calls) and not summary["completed"]
    resumed = Recorder()
    with pinned():
        session = set_up(config, tmp_path, True, hooks=[resumed, SummaryEntry("note", 7)])
        summary = run(session, BatchSteps())
    assert resumed.calls[:3] == [("setup", 4), ("on_restore", 3), ("on_start", 3)]
    assert resumed.calls[-3:] == [("on_step_end", 4, False), ("on_end", 4), ("on_summary", 4)]
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["note"] == summary["note"] == 7 and written["completed"]
