"""The GPU check in one command: on a bare GPU machine (no network), install towerrec from
the wheels brought along, run the tests that take a CUDA device and the GPU benchmarks,
and write one JSON and the pytest log into an output folder, within a time budget.

Here, where pip reaches PyPI::

    python tools/device_check.py wheels              # .whl/: towerrec's wheel and those
                                                     # tools/device_wheels.txt lists
There (``tools/device_check.sh OUT`` runs this)::

    python3 tools/device_check.py run --out OUT      # device_check.json, pytest.log
    python3 tools/device_check.py run --out OUT --cpu --skip-install   # the plan on a CPU

``run`` executes a plan of steps in order (install, environment, the CUDA tests, the
benchmarks), each under its own cap and the time left of ``--budget-s``; a step that
fails or runs out of time is recorded and the next runs. The JSON holds every step's
command, exit status, seconds and output tail, the tests' counts and failures, each
benchmark's JSON, and the issue's targets judged from them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = ROOT / "tools" / "device_wheels.txt"
WHEEL_BYTES_LIMIT = 64 << 20  # what travels with a device command, the tree included
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
BUDGET_S = 480  # the 8 minutes
DEVICE_PYTHON = "3.12"  # the GPU machine's Python: towerrec's wheel (a C extension) is built for it


@dataclass
class Step:
    """One command of the plan: ``argv``, at most ``cap_s`` seconds; ``bench`` steps print
    one JSON object, kept in the report."""

    name: str
    argv: list[str]
    cap_s: float
    bench: bool = False
    log: str = ""  # a file under --out that receives the whole output


@dataclass
class Outcome:
    name: str
    argv: list[str]
    rc: int | None  # None: not run (no time left)
    seconds: float
    timed_out: bool = False
    output_tail: str = ""
    result: dict | None = None
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------- wheels (here)
def read_wheel_list(path: Path = WHEEL_LIST) -> list[str]:
    """The pinned requirements of ``path`` (comments and blank lines skipped); each must
    pin one version (``name==version``), so that the machine gets what was tested."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+", text):
            raise ValueError(
                f"{path}:{number}: {text!r} is not a pinned requirement; write name==version"
            )
        out.append(text)
    return out


def builder_python(explicit: str | None = None) -> str:
    """The interpreter that builds towerrec's wheel: ``explicit``, else this one when it is
    the device's Python, else ``python3.12`` on the PATH. The wheel holds a compiled
    extension, so one built by another Python does not install there."""
    if explicit:
        return explicit
    here = ".".join(map(str, sys.version_info[:2]))
    if here == DEVICE_PYTHON:
        return sys.executable
    found = shutil.which(f"python{DEVICE_PYTHON}")
    if found is None:
        raise ValueError(
            f"towerrec's wheel must be built by Python {DEVICE_PYTHON}, the GPU machine's, and "
            f"this is {here} with no "
            f"python{DEVICE_PYTHON} on the PATH; pass --python PATH (e.g. a {DEVICE_PYTHON} venv's "
            "python)"
        )
    return found


def download_commands(
    requirements: Sequence[str], dest: Path, python: str | None = None
) -> list[list[str]]:
    """The commands that put towerrec's wheel (built by ``python``, default this
    interpreter) and ``requirements``' (CPython 3.12, manylinux x86_64, binaries only, no
    dependencies) into ``dest``."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    builder = python or sys.executable
    return [
        [builder, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest), str(ROOT)],
        [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms,
            "-d", str(dest), *requirements,
        ],
    ]  # fmt: skip


def check_wheels(dest: Path, limit: int = WHEEL_BYTES_LIMIT) -> dict:
    """``dest``'s wheels and their sizes; refuses a set over ``limit`` bytes or two
    versions of one package (either stops the install there)."""
    wheels = sorted(dest.glob("*.whl"))
    names = [w.name.split("-")[0].lower().replace("_", "-") for w in wheels]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{dest} holds two versions of {', '.join(twice)}; keep one of each")
    cp = "cp" + DEVICE_PYTHON.replace(".", "")
    for w in wheels:
        tags = w.name[: -len(".whl")].split("-")
        python, abi = (tags[-3], tags[-2]) if len(tags) >= 5 else ("py3", "none")
        if not ({"py3", cp} & set(python.split(".")) and abi in ("none", "abi3", cp)):
            raise ValueError(
                f"{w.name} is built for {python}, and the GPU machine runs Python "
                f"{DEVICE_PYTHON}: rebuild with `python tools/device_check.py wheels --python "
                f"python{DEVICE_PYTHON}`"
            )
    sizes = {w.name: w.stat().st_size for w in wheels}
    total = sum(sizes.values())
    if total > limit:
        raise ValueError(
            f"the wheels in {dest} come to {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} "
            "MiB that travel with a device command; drop what the machine has"
        )
    return {"wheels": sizes, "total_bytes": total}


def build_wheels(
    dest: Path, runner: Callable[[list[str]], None] | None = None, python: str | None = None
) -> dict:
    """``wheels``: a fresh ``dest`` with towerrec's wheel (built by ``builder_python``) and
    the listed ones, checked; writes ``dest/MANIFEST.json`` (the wheels and the commit
    they were built from)."""
    run = runner or (lambda argv: subprocess.run(argv, check=True))
    requirements = read_wheel_list()
    builder = builder_python(python)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for argv in download_commands(requirements, dest, builder):
        run(argv)
    manifest = {**check_wheels(dest), "requirements": requirements, "commit": _commit()}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------- plan (there)
def plan(args: argparse.Namespace) -> list[Step]:
    """The steps of ``run``, in priority order (module doc); ``--cpu``: the same at sizes
    a CPU runs in seconds."""
    py = [sys.executable]
    towerrec = [*py, "-m", "towerrec", "bench"]
    device = "cpu" if args.cpu else "cuda"
    steps = []
    if not args.skip_install:
        steps.append(Step("install", [*py, "-m", "pip", "install", "-q", "--no-index",
                                      "--find-links", args.wheels, "towerrec",
                                      "pytest-random-order"], 90))  # fmt: skip
    steps.append(Step("environment", [*py, str(ROOT / "tools" / "device_check.py"), "env"], 60))
    if not args.skip_tests:
        marker = "cuda and not slow" if args.cpu else "cuda"
        steps.append(
            Step(
                "pytest",
                [*py, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-rA",
                 "--timeout", "240", *args.pytest_args],
                args.pytest_cap_s,
                log="pytest.log",
            )
        )  # fmt: skip
    if args.skip_bench:
        return steps
    small = args.cpu
    train = [*towerrec, "train", "--device", device, "--peer", "plain"]
    train += (
        ["--batch-size", "256", "--steps", "4", "--warmup", "1", "--rounds", "2"]
        if small
        else ["--batch-size", "16384", "--steps", "60", "--warmup", "10", "--rounds", "5"]
    )
    steps.append(Step("bench_train", train, 120, bench=True))
    tiers = [*towerrec, "tiers", "--device", device, "--ids", "zipf", "--path", args.tmp]
    tiers += (
        ["--gib", "0.02", "--dim", "8", "--batch-size", "256", "--min-rows", "50000",
         "--cache-fraction", "0.005", "--steps", "3", "--warmup", "3"]
        if small
        else ["--gib", "2", "--batch-size", "8192", "--steps", "30", "--warmup", "30"]
    )  # fmt: skip
    steps.append(Step("bench_tiers", [*tiers, "--variants", "device,host,ssd"], 150, bench=True))
    dmt = [*towerrec, "dmt-compute", "--device", device]
    if small:
        dmt += ["--shapes", str(ROOT / "tools" / "device_check_small_shapes.json")]
    steps.append(Step("bench_dmt_compute", dmt, 90, bench=True))
    # Last, if time is left: the host bookkeeping, the cache as it ran before.
    steps.append(
        Step(
            "bench_tiers_host_maps",
            [*tiers, "--variants", "device,host", "--cache-maps", "host"],
            120,
            bench=True,
        )
    )
    return steps


def run_step(step: Step, cap_s: float, out: Path, env: dict[str, str]) -> Outcome:
    """Run ``step`` for at most ``cap_s`` seconds (its output into ``out/step.log`` when
    it names one)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            step.argv, capture_output=True, text=True, timeout=cap_s, cwd=ROOT, env=env
        )
        rc, stdout, stderr, timed_out = proc.returncode, proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        stdout = _text(e.stdout)
        stderr = _text(e.stderr)
    seconds = round(time.monotonic() - start, 2)
    if step.log:
        (out / step.log).write_text(stdout + stderr)
    outcome = Outcome(step.name, step.argv, rc, seconds, timed_out, (stdout + stderr)[-3000:])
    if step.bench and rc == 0:
        try:
            outcome.result = json.loads(stdout)
            outcome.output_tail = stderr[-3000:]
        except ValueError:
            outcome.extra["error"] = "the benchmark printed no JSON object"
    if step.name == "environment" and rc == 0:
        outcome.result = json.loads(stdout)
    if step.name == "pytest":
        outcome.extra.update(pytest_counts(stdout))
    return outcome


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def pytest_counts(log: str) -> dict:
    """The counts of pytest's closing line and the failed tests' names, from its log."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    closing = [line for line in log.splitlines() if re.match(r"=+ .* in [\d.]+s", line)]
    if closing:
        for number, word in re.findall(r"(\d+) (\w+)", closing[-1]):
            key = "errors" if word.startswith("error") else word
            if key in counts:
                counts[key] = int(number)
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, flags=re.MULTILINE)
    return {**counts, "failures": failures}


def targets(outcomes: dict[str, Outcome], total_s: float, budget_s: float) -> dict:
    """The issue's targets, judged from what ran (None: not measured)."""

    def judge(value: float | None, bound: float, at_least: bool = True) -> dict:
        met = None if value is None else (value >= bound if at_least else value <= bound)
        return {"value": value, "target": bound, "met": met}

    out: dict[str, dict] = {"device_check_seconds": judge(total_s, budget_s, at_least=False)}
    train = outcomes.get("bench_train")
    if train and train.result:
        for precision, row in train.result.get("precisions", {}).items():
            ref = row["plain_reference"]
            mine = [n for n in row["results"] if n.startswith("towerrec_")]
            best = max(mine, key=lambda n: row["results"][n]["samples_per_s"], default=None)
            if best is None:
                continue
            ratio = row["ratios"].get(f"{best}/{ref}")
            out[f"train_{precision}_vs_plain"] = judge(ratio, 1.2)
            out[f"train_{precision}_roofline_fraction"] = judge(
                row["results"][best]["roofline_fraction"], 0.5
            )
    tiers = outcomes.get("bench_tiers")
    if tiers and tiers.result:
        ratio = tiers.result.get("ratios", {}).get("host/link_bound")
        out["tiers_host_vs_link_bound"] = judge(ratio, 1 / 1.25)
    tests = outcomes.get("pytest")
    if tests:
        failed = tests.extra.get("failed", 0) + tests.extra.get("errors", 0)
        out["cuda_tests_failed"] = judge(failed if tests.rc is not None else None, 0, False)
    return out


def run(args: argparse.Namespace, runner: Callable[..., Outcome] = run_step) -> dict:
    """``run``: the plan within the budget, into ``args.out/device_check.json``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    for step in plan(args):
        left = args.budget_s - (time.monotonic() - start)
        if left < min(step.cap_s, 20):
            outcomes[step.name] = Outcome(
                step.name, step.argv, None, 0.0, extra={"skipped": "no time left"}
            )
            continue
        outcomes[step.name] = runner(step, min(step.cap_s, left), out, env)
        if step.name == "install" and outcomes[step.name].rc != 0:
            # The image's environment refused the install: the wheels into a folder of
            # their own, on the path of every later step.
            site = str(Path(args.tmp) / "site")
            fallback = Step("install_target", [sys.executable, "-m", "pip", "install", "-q",
                                               "--no-index", "--no-deps", "--target", site,
                                               *map(str, Path(args.wheels).glob("*.whl"))], 90)  # fmt: skip
            outcomes[fallback.name] = runner(fallback, min(90, left), out, env)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    total = round(time.monotonic() - start, 1)
    manifest = Path(args.wheels) / "MANIFEST.json"
    report = {
        "check": "towerrec device check",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "seconds": total,
        "budget_s": args.budget_s,
        "wheels": json.loads(manifest.read_text()) if manifest.exists() else None,
        "steps": {name: asdict(o) for name, o in outcomes.items()},
        "targets": targets(outcomes, total, args.budget_s),
    }
    (out / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def environment() -> dict:
    """``env``: what the machine runs (printed as JSON by the plan's environment step)."""
    import importlib.util
    import platform

    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "triton": importlib.util.find_spec("triton") is not None,
        "fbgemm_gpu": importlib.util.find_spec("fbgemm_gpu") is not None,
        "cpu_cores": os.cpu_count(),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="device_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="build .whl here (towerrec and the listed wheels)")
    w.add_argument("--dest", default=str(ROOT / ".whl"))
    w.add_argument(
        "--python",
        help=f"the Python {DEVICE_PYTHON} that builds towerrec's wheel (default: this one if it "
        f"is {DEVICE_PYTHON}, else python{DEVICE_PYTHON} on the PATH)",
    )
    r = sub.add_parser("run", help="install, test and benchmark on the device")
    r.add_argument("--out", required=True, help="folder for device_check.json and pytest.log")
    r.add_argument("--wheels", default=str(ROOT / ".whl"), help="the wheels brought along")
    r.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all steps")
    r.add_argument("--pytest-cap-s", type=float, default=240, help="seconds for the tests")
    r.add_argument("--cpu", action="store_true", help="the plan at small sizes on the CPU")
    r.add_argument("--skip-install", action="store_true")
    r.add_argument("--skip-tests", action="store_true")
    r.add_argument("--skip-bench", action="store_true")
    r.add_argument("--tmp", default="/tmp/towerrec-device-check", help="the tiers' row files")
    r.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed on")
    sub.add_parser("env", help="print the machine's Python, torch, CUDA and GPU as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "wheels":
        try:
            print(json.dumps(build_wheels(Path(args.dest), python=args.python), indent=2))
        except ValueError as e:
            parser().exit(2, f"device_check wheels: {e}\n")
    elif args.command == "env":
        print(json.dumps(environment()))
    else:
        if args.budget_s <= 0 or args.pytest_cap_s <= 0:
            parser().error("--budget-s and --pytest-cap-s must be > 0")
        report = run(args)
        failed = [n for n, s in report["steps"].items() if s["rc"] not in (0, None)]
        print(json.dumps({"seconds": report["seconds"], "failed_steps": failed,
                          "targets": report["targets"]}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
