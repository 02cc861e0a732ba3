"""The planner registry: one entry per planner, a typed request, the shorthand."""

import pytest

from towerrec.planner.algorithms import GREEDY_KEYS, lpt
from towerrec.planner.cost import CostModel
from towerrec.planner.learned_planners import LEARNED_PLANNERS
from towerrec.planner.search import (
    PLANNERS,
    Planner,
    PlanRequest,
    get_planner,
    plan_tables,
    register,
)
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import dlrm_like_suite
from towerrec.planner.topology import topology_preset


def _model() -> CostModel:
    return CostModel(topology_preset("gpu", 1, 4), None, 512)


def test_every_planner_has_one_entry_under_its_name_in_a_stable_order():
    expected = [*GREEDY_KEYS, "lpt", "search", "neuroshard", *LEARNED_PLANNERS]
    assert list(PLANNERS) == expected
    assert all(entry.name == name for name, entry in PLANNERS.items())


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        register(Planner("lpt", PLANNERS["lpt"].place))
    assert list(PLANNERS).count("lpt") == 1


def test_an_unknown_planner_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown planner 'bogus'; choose one of greedy_size"):
        get_planner("bogus")
    with pytest.raises(ValueError, match="unknown planner 'bogus'"):
        plan_tables(dlrm_like_suite(4), _model(), "bogus")


def test_the_request_refuses_an_empty_or_ambiguous_task():
    with pytest.raises(ValueError, match="nothing to plan"):
        PlanRequest([], _model())
    with pytest.raises(ValueError, match="table names must be unique"):
        PlanRequest([TableStats("a", 10, 8), TableStats("a", 20, 8)], _model())


def test_the_shorthand_plans_what_the_entry_plans():
    suite = dlrm_like_suite(12, seed=2)
    request = PlanRequest(suite, _model(), seed=5)
    for name in ("random", "lpt", "search"):
        one = get_planner(name).plan(request)
        two = plan_tables(suite, _model(), name, seed=5)
        assert one.plan == two.plan and one.device_costs == two.device_costs


def test_a_planner_outside_the_registry_runs_the_same_steps():
    """A new planner is an entry: its placing alone, memory and splits come with it."""

    def plain_lpt(request, items, loads):
        lpt(items, loads)

    suite = dlrm_like_suite(12, seed=2)
    result = Planner("plain_lpt", plain_lpt).plan(PlanRequest(suite, _model()))
    assert result.planner == "plain_lpt"
    assert set(result.plan.tables) == {s.name for s in suite}
    assert "plain_lpt" not in PLANNERS
