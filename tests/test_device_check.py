"""tools/device_check.py, its CPU side: the wheel list, the plan's arguments, and the JSON
it writes (the steps run by a stand-in here; the GPU run itself is the tool's)."""

import importlib.util
import json
import sys
import zipfile

import pytest
from conftest import ROOT

from towerrec.cli.app import build_parser


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "tools/device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["device_check"]


def run_args(tool, tmp_path, *extra):
    return tool.parser().parse_args(
        ["run", "--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "whl"), *extra]
    )


def test_the_wheel_list_pins_every_wheel_and_a_loose_one_is_refused(tool, tmp_path):
    listed = tool.read_wheel_list()
    names = {r.split("==")[0] for r in listed}
    assert {"tomli-w", "lmdb", "pytest-random-order"} <= names
    assert all("==" in r for r in listed)
    loose = tmp_path / "wheels.txt"
    loose.write_text("# comment\ntomli-w==1.2.0\nlmdb>=1.4\n")
    with pytest.raises(ValueError, match=r"wheels.txt:3: 'lmdb>=1.4' is not a pinned"):
        tool.read_wheel_list(loose)


def test_download_commands_fetch_cpython_312_manylinux_binaries(tool, tmp_path):
    wheel, download = tool.download_commands(["lmdb==3.0.0"], tmp_path)
    assert wheel[-1] == str(ROOT) and "--no-deps" in wheel  # towerrec's own wheel
    assert download[download.index("--python-version") + 1] == "3.12"
    assert "--only-binary=:all:" in download and "manylinux_2_17_x86_64" in download
    assert download[-1] == "lmdb==3.0.0"


def _wheel(path, size=10):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x", b"0" * size)


def test_wheels_over_the_limit_or_twice_are_refused(tool, tmp_path):
    _wheel(tmp_path / "lmdb-3.0.0-cp312-cp312-manylinux2014_x86_64.whl")
    _wheel(tmp_path / "tomli_w-1.2.0-py3-none-any.whl")
    sizes = tool.check_wheels(tmp_path)
    assert set(sizes["wheels"]) == {p.name for p in tmp_path.glob("*.whl")}
    with pytest.raises(ValueError, match="MiB, over the 0 MiB"):
        tool.check_wheels(tmp_path, limit=100)
    _wheel(tmp_path / "tomli_w-1.1.0-py3-none-any.whl")
    with pytest.raises(ValueError, match="two versions of tomli-w"):
        tool.check_wheels(tmp_path)


def test_a_wheel_for_another_python_is_refused_naming_the_fix(tool, tmp_path):
    _wheel(tmp_path / "towerrec-0.1.0-cp311-cp311-linux_x86_64.whl")
    with pytest.raises(ValueError, match=r"built for cp311.*runs Python 3.12.*--python"):
        tool.check_wheels(tmp_path)
    (tmp_path / "towerrec-0.1.0-cp311-cp311-linux_x86_64.whl").unlink()
    _wheel(tmp_path / "towerrec-0.1.0-cp312-cp312-linux_x86_64.whl")
    _wheel(tmp_path / "x-1.0-cp312-abi3-manylinux2014_x86_64.whl")
    assert len(tool.check_wheels(tmp_path)["wheels"]) == 2


def test_the_wheel_builder_is_the_devices_python(tool, monkeypatch):
    assert tool.builder_python("/given/python") == "/given/python"
    monkeypatch.setattr(tool.sys, "version_info", (3, 11, 7))
    monkeypatch.setattr(tool.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"built by Python 3.12.*--python PATH"):
        tool.builder_python()
    monkeypatch.setattr(tool.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert tool.builder_python() == "/usr/bin/python3.12"


def test_build_wheels_writes_a_manifest(tool, tmp_path):
    dest = tmp_path / "whl"
    ran = []

    def fake_pip(argv):  # what pip would leave in the folder
        ran.append(argv)
        name = "towerrec-0.1.0-py3-none-any.whl" if "wheel" in argv else "lmdb-3.0.0-cp312.whl"
        _wheel(dest / name)

    manifest = tool.build_wheels(dest, runner=fake_pip, python="/venv312/bin/python")
    assert len(ran) == 2 and ran[0][0] == "/venv312/bin/python"  # the device's Python builds it
    assert json.loads((dest / "MANIFEST.json").read_text()) == manifest
    assert manifest["requirements"] == tool.read_wheel_list()
    assert set(manifest["wheels"]) == {"towerrec-0.1.0-py3-none-any.whl", "lmdb-3.0.0-cp312.whl"}


@pytest.mark.parametrize("cpu", [True, False])
def test_every_benchmark_of_the_plan_parses_on_the_command_line(tool, tmp_path, cpu):
    args = run_args(tool, tmp_path, *(["--cpu"] if cpu else []))
    steps = tool.plan(args)
    names = [s.name for s in steps]
    assert names[:3] == ["install", "environment", "pytest"]
    assert [n for n in names if n.startswith("bench")] == [
        "bench_train",
        "bench_tiers",
        "bench_dmt_compute",
        "bench_tiers_host_maps",
    ]
    parser = build_parser()
    for step in steps:
        if step.bench:
            at = step.argv.index("bench")
            parsed = parser.parse_args(step.argv[at:])
            assert parsed.device == ("cpu" if cpu else "cuda"), step.name
    pytest_step = steps[2]
    assert "cuda" in pytest_step.argv[pytest_step.argv.index("-m", 3) + 1]
    assert pytest_step.log == "pytest.log"


def test_bad_arguments_are_refused(tool, tmp_path, capsys):
    with pytest.raises(SystemExit):
        tool.parser().parse_args(["run"])  # --out is required
    with pytest.raises(SystemExit):
        tool.main(["run", "--out", str(tmp_path), "--budget-s", "0"])
    assert "--budget-s and --pytest-cap-s must be > 0" in capsys.readouterr().err


def _fake_result(name):
    if name == "bench_train":
        row = {
            "results": {
                "towerrec_torch": {"samples_per_s": 300.0, "roofline_fraction": 0.6},
                "plain_fused": {"samples_per_s": 200.0, "roofline_fraction": 0.4},
            },
            "plain_reference": "plain_fused",
            "ratios": {"towerrec_torch/plain_fused": 1.5},
        }
        return {"precisions": {"fp32": row}}
    if name.startswith("bench_tiers"):
        return {"ratios": {"host/link_bound": 0.7}}
    return {"shapes": []}


def test_the_report_holds_every_step_and_judges_the_targets(tool, tmp_path):
    args = run_args(tool, tmp_path, "--skip-install")
    log = "== 3 passed, 1 failed, 2 skipped in 4.20s ==\nFAILED tests/test_cuda.py::test_x - boom\n"

    def runner(step, cap_s, out, env):
        assert cap_s <= step.cap_s
        outcome = tool.Outcome(step.name, step.argv, 0, 1.0)
        if step.bench:
            outcome.result = _fake_result(step.name)
        if step.name == "pytest":
            (out / step.log).write_text(log)
            outcome.rc = 1
            outcome.extra.update(tool.pytest_counts(log))
        return outcome

    report = tool.run(args, runner=runner)
    written = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert set(written["steps"]) == {
        "environment",
        "pytest",
        "bench_train",
        "bench_tiers",
        "bench_dmt_compute",
        "bench_tiers_host_maps",
    }
    tests = written["steps"]["pytest"]["extra"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (3, 1, 2)
    assert tests["failures"] == ["tests/test_cuda.py::test_x"]
    judged = written["targets"]
    assert judged["train_fp32_vs_plain"] == {"value": 1.5, "target": 1.2, "met": True}
    assert judged["train_fp32_roofline_fraction"]["met"] is True
    assert judged["tiers_host_vs_link_bound"]["met"] is False  # 0.7 < 1 / 1.25
    assert judged["cuda_tests_failed"] == {"value": 1, "target": 0, "met": False}
    assert judged["device_check_seconds"]["met"] is True


def test_steps_without_time_left_are_recorded_not_run(tool, tmp_path):
    args = run_args(tool, tmp_path, "--skip-install", "--budget-s", "10")
    report = tool.run(args, runner=lambda *a: pytest.fail("ran a step without time left"))
    assert all(s["rc"] is None and s["extra"]["skipped"] for s in report["steps"].values())


def test_a_real_step_runs_with_its_cap_and_keeps_its_log(tool, tmp_path):
    step = tool.Step("bench_x", [sys.executable, "-c", "print('{\"a\": 1}')"], 60, bench=True)
    outcome = tool.run_step(step, 60, tmp_path, {})
    assert outcome.rc == 0 and outcome.result == {"a": 1}
    slow = tool.Step(
        "pytest", [sys.executable, "-c", "import time; time.sleep(30)"], 60, log="p.log"
    )
    outcome = tool.run_step(slow, 0.5, tmp_path, {})
    assert outcome.timed_out and outcome.rc is None and (tmp_path / "p.log").exists()


def test_pytest_counts_read_the_closing_line(tool):
    counts = tool.pytest_counts("x\n===== 2 passed, 1 error, 4 deselected in 0.10s =====\n")
    assert (counts["passed"], counts["errors"], counts["deselected"]) == (2, 1, 4)
    assert tool.pytest_counts("killed before the end")["passed"] == 0
