"""The supported versions: one statement in towerrec.compat, the same in pyproject, and a
clear refusal of what is older."""

import tomllib

import pytest
from conftest import ROOT

from towerrec.compat import (
    MIN_PYTHON,
    MIN_TORCH,
    TESTED,
    check_versions,
    fbgemm_weight_decay_mode,
    version_tuple,
)


def test_pyproject_states_the_supported_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">={}.{}".format(*MIN_PYTHON)
    minimum = "torch>={}.{}".format(*MIN_TORCH)
    assert minimum in project["dependencies"]
    assert not [d for d in project["dependencies"] if d.startswith("torch==")]  # a range
    assert "torch==2.13.0" in project["optional-dependencies"]["cpu"]  # what CI installs
    versions = {
        tuple(int(p) for p in c.rsplit(":: ", 1)[1].split("."))
        for c in project["classifiers"]
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert versions == set(TESTED)


def test_version_tuple_reads_local_and_pre_releases():
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("2.15.0a0+git123") == (2, 15, 0)
    assert version_tuple("unknown") == ()


def test_older_python_or_torch_is_refused_naming_the_fix():
    check_versions((3, 12), "2.11.0+cu130")
    check_versions((3, 13), "2.14.1")
    with pytest.raises(RuntimeError, match=r"needs Python 3\.11 or newer, this is 3\.10"):
        check_versions((3, 10), "2.13.0")
    with pytest.raises(RuntimeError, match=r"needs torch 2\.11 or newer, this is 2\.10\.1.*pip"):
        check_versions((3, 11), "2.10.1")
    check_versions()  # the running interpreter and torch


def test_fbgemm_weight_decay_mode_has_the_modes_the_kernel_uses():
    pytest.importorskip("fbgemm_gpu")
    modes = fbgemm_weight_decay_mode()
    assert {"NONE", "L2", "DECOUPLE"} <= set(modes.__members__)
