"""``towerrec bench nas``: does the search find a cheaper model that scores as well?

::

    emb_dim on MovieLens (time split: validation, then test, the latest ratings)
        baseline   every table at 64                      train -> test AUC, params
        search     emb_dim supernet, cost = parameters    -> arch-0.toml
        retrain    arch-0 from scratch, the same recipe   train -> test AUC, params
        target     params <= 0.5 x baseline, test AUC >= baseline - 0.003

    emb_card on MovieLens (the same splits; every table at the config's dim 16)
        baseline   every table at its full cardinality        train -> test AUC, params
        search     emb_card supernet (rows / 1, 2, 4, 8 per table: hashed), cost = parameters
        retrain    arch-0 from scratch, the same recipe   train -> test AUC, params
        target     params <= 0.5 x baseline, test AUC >= baseline - 0.003

    mlp on generated Criteo-format files (day_0 train, day_1 validation, day_2 test)
        baseline   the widest MLPs of the space            train -> test log-loss, FLOPs
        search     mlp supernet, cost = MLP FLOPs          -> arch-0.toml
        retrain    arch-0 from scratch                     train -> test log-loss, FLOPs
        target     FLOPs <= 0.5 x baseline, log-loss <= 1.003 x baseline

The search picks the architecture on the validation split; the verdict is read on
the test split, which neither the search nor training sees. Each seed sets the
search's and both runs' ``train.seed``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.build.models import build_model
from towerrec.build.sources import build_source
from towerrec.config import Config, load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.models.dlrm import DLRM
from towerrec.workflows.nas.search import search
from towerrec.workflows.training import train

__all__ = ["BENCHMARK"]

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

EMB_DIM = [
    "model.embedding_dim=64",
    "model.bottom_mlp=[32,64]",
    "data.movielens.eval_fraction=0.15",
    "data.movielens.test_fraction=0.15",
    "train.eval_every=0",
    "train.progress=false",
    "nas.space=emb_dim",
    "nas.emb_dim.candidates=[4,8,16,32,64]",
]
EMB_CARD = [
    "data.movielens.eval_fraction=0.15",
    "data.movielens.test_fraction=0.15",
    "train.eval_every=0",
    "train.progress=false",
    "nas.space=emb_card",
    "nas.emb_card.candidates=[1.0,2.0,4.0,8.0]",
]
MLP = [
    "train.batch_size=512",
    "train.epochs=2",
    "model.bottom_mlp=[128,64,16]",
    "model.top_mlp=[512,256,1]",
    "train.eval_every=0",
    "train.progress=false",
    "nas.space=mlp",
    "nas.mlp.bottom=[[128,64,32],[64,32,16,0]]",
    "nas.mlp.top=[[512,256,128,64],[256,128,64,32,0]]",
]


def _cost(config: Config, space: str) -> int:
    model = build_model(config, build_source(config.data).schema, torch.device("cpu"))
    assert isinstance(model, DLRM)  # the search's backbone
    if space == "mlp":
        assert model.bottom is not None  # Criteo-format data has dense features
        return model.bottom.flops_per_sample() + model.top.flops_per_sample()
    return model.sparse.num_embedding_parameters


def _criteo_cache(root: Path, rows: int) -> Path:
    paths = generate_criteo_files(root / "raw", 3, rows, seed=0)
    options = CriteoOptions(num_embeddings=(5000,), eval_files=("day_1",), test_files=("day_2",))
    with contextlib.redirect_stdout(sys.stderr):
        preprocess_criteo(paths, root / "cache", options, progress=False)
    return root / "cache"


# space -> (its fixed overrides, its base config)
SPACES = {
    "emb_dim": (EMB_DIM, "movielens.toml"),
    "emb_card": (EMB_CARD, "movielens.toml"),
    "mlp": (MLP, "criteo.toml"),
}


def _one(space: str, overrides: list[str], seed: int, work: Path) -> dict[str, Any]:
    sets = [*overrides, f"train.seed={seed}", f"data.loader.seed={seed}"]
    base_file = CONFIGS / SPACES[space][1]
    config = load_config(base_file, sets)
    baseline = train(config, work / f"baseline-{seed}")
    report = search(config, work / f"search-{seed}", progress=False)
    arch = load_config(work / f"search-{seed}" / "arch-0.toml", [])
    arch = replace(arch, nas=config.nas)
    retrained = train(arch, work / f"arch-{seed}")
    base_cost, arch_cost = _cost(config, space), _cost(arch, space)
    return {
        "seed": seed,
        "choice": report["architectures"][0]["choice"],
        "baseline": {"cost": base_cost, **baseline["test"]},
        "arch": {"cost": arch_cost, **retrained["test"]},
        "cost_ratio": arch_cost / base_cost,
        "auc_diff": retrained["test"]["auc"] - baseline["test"]["auc"],
        "logloss_ratio": retrained["test"]["logloss"] / baseline["test"]["logloss"],
        "search_steps": report["steps"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    unknown = [s for s in args.spaces if s not in SPACES]
    if unknown:
        raise ValueError(f"--spaces {','.join(unknown)}: unknown; choose from {', '.join(SPACES)}")
    out: dict[str, Any] = {"machine": machine_info()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for space in args.spaces:
            overrides = list(SPACES[space][0])
            if space == "mlp":
                overrides.append(f"data.path={_criteo_cache(work / 'criteo', args.criteo_rows)}")
            overrides += [f"nas.cost_weight={args.cost_weight[space]}", *args.overrides]
            runs = [_one(space, overrides, seed, work / space) for seed in args.seeds]
            mean = {
                k: statistics.fmean(r[k] for r in runs)
                for k in ("cost_ratio", "auc_diff", "logloss_ratio")
            }
            if space in ("emb_dim", "emb_card"):
                met = mean["cost_ratio"] <= 0.5 and mean["auc_diff"] >= -0.003
                full = "all-64" if space == "emb_dim" else "full-cardinality"
                target = f"params <= 0.5x the {full} model's, test AUC within 0.003"
            else:
                met = mean["cost_ratio"] <= 0.5 and mean["logloss_ratio"] <= 1.003
                target = "MLP FLOPs <= 0.5x the widest model's, test log-loss within 0.3%"
            out[space] = {
                "overrides": overrides,
                "runs": runs,
                "mean": mean,
                "target": target,
                "met": met,
            }
    return out


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spaces",
        type=comma_list,
        default=("emb_dim", "mlp"),
        help="emb_dim,mlp (the default), emb_card",
    )
    parser.add_argument(
        "--seeds", type=lambda s: [int(x) for x in comma_list(s)], default=[0], help="0,1,2"
    )
    parser.add_argument("--criteo-rows", type=int, default=20000, help="rows per generated file")
    parser.add_argument(
        "--emb-dim-cost-weight",
        type=float,
        default=0.1,
        help="nas.cost_weight of the emb_dim search",
    )
    parser.add_argument(
        "--emb-card-cost-weight",
        type=float,
        default=0.1,
        help="nas.cost_weight of the emb_card search",
    )
    parser.add_argument(
        "--mlp-cost-weight",
        type=float,
        default=0.0,
        help="nas.cost_weight of the mlp search (from 0.01 up it took the cheapest MLP)",
    )
    add_overrides_argument(parser, "config override for every run (search and trainings)")
    parser.set_defaults(cost_weight=None)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    args.cost_weight = {
        "emb_dim": args.emb_dim_cost_weight,
        "emb_card": args.emb_card_cost_weight,
        "mlp": args.mlp_cost_weight,
    }
    return run(args)


BENCHMARK = Benchmark(
    help="DNAS: emb_dim and emb_card searches on MovieLens, mlp search on Criteo-format files, "
    "against the baseline",
    add_arguments=_add_arguments,
    run=_run,
)
