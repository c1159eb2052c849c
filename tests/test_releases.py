"""Release ranges (issue 62): a framework installed outside the range its integration supports, or
missing an API the integration needs, makes its cases UNSUPPORTED before any rank starts, naming
the release and the range; `sp-harness env` says the same per framework; a release case's
expected verdict follows the installed release. Releases are faked with a distribution's metadata
(a `.dist-info` folder ahead of site-packages on PYTHONPATH): the question is asked of the
metadata, so the installed framework's code is the real one throughout."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_optional_frameworks import Hidden

from sp_harness.cases.frameworks import COMPAT, FRAMEWORK_CASES, installed, unavailable
from sp_harness.cases.frameworks.releases import (
    PROBE_CACHE_ENV,
    ReleaseRange,
    ShippedBug,
    installed_release,
    outside,
    probe,
    release_key,
    require,
)
from sp_harness.cli import EXIT_OK
from sp_harness.config.case import Unsupported


def _fake_release(folder: Path, distribution: str, release: str) -> None:
    info = folder / f"{distribution.replace('-', '_')}-{release}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {release}\n")


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A folder on sys.path (first) for fake distributions' metadata."""
    folder = tmp_path / "fakes"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    return folder


def test_release_keys_compare_as_releases():
    assert release_key("0.19.0rc1") == (0, 19, 0)
    assert release_key("4.45.2") < release_key("4.46.0") < release_key("4.100.0")
    with pytest.raises(ValueError, match="'main'"):
        release_key("main")
    with pytest.raises(ValueError, match="oldest 2.0 is newer than newest 1.0"):
        ReleaseRange(distribution="x", oldest="2.0", newest="1.0")


def test_outside_names_the_release_and_the_range(fakes):
    _fake_release(fakes, "spfake-framework", "1.2.3")
    below = ReleaseRange(distribution="spfake-framework", oldest="1.3.0", newest="2.0.0")
    assert outside((below,)) == ("spfake-framework 1.3.0 to 2.0.0 (the supported range), "
                                 "and spfake-framework 1.2.3 is installed")
    assert outside((ReleaseRange(distribution="spfake-framework", oldest="1.2.0", newest="1.2.3"),)) is None
    # a newest end of fewer parts admits its patch releases: "0.19" is 0.19.x
    assert outside((ReleaseRange(distribution="spfake-framework", oldest="1.0", newest="1.2"),)) is None
    assert outside((ReleaseRange(distribution="spfake-not-installed", oldest="1.0", newest="2.0"),)) is None


def test_a_shipped_bug_is_present_only_on_its_releases(fakes):
    _fake_release(fakes, "spfake-framework", "4.47.0")
    bug = ShippedBug(distribution="spfake-framework", first="4.47.0", fixed="4.47.1", stage="reported loss",
                     summary="s", source="https://example.invalid/1")
    assert bug.present()
    assert not ShippedBug(**{**bug.__dict__, "first": "4.45.0", "fixed": "4.47.0"}).present()
    assert not ShippedBug(**{**bug.__dict__, "distribution": "spfake-not-installed"}).present()
    # no release fixes it yet: present from `first` on
    assert ShippedBug(**{**bug.__dict__, "first": "4.45.0", "fixed": None}).present()
    assert not ShippedBug(**{**bug.__dict__, "first": "4.48.0", "fixed": None}).present()


def test_a_missing_api_is_unsupported_naming_it(tmp_path, monkeypatch):
    """`require` asks the compat module's `missing()` in a child interpreter (which sees this
    process's sys.path) and names what it lacks."""
    (tmp_path / "spfake_compat.py").write_text(
        "from sp_harness.cases.frameworks.releases import ReleaseRange\n"
        "RELEASES = (ReleaseRange(distribution='pytest', oldest='1.0', newest='99.0'),)\n"
        "def missing():\n    return ('spfake.Trainer._inner_loop',)\n")
    (tmp_path / "spfake_broken.py").write_text("RELEASES = ()\nraise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Unsupported, match=r"my-case needs spfake\.Trainer\._inner_loop, which pytest \S+ lacks "
                                          r"\(supported: pytest 1\.0 to 99\.0\)"):
        require("spfake_compat", "my-case")
    assert probe("spfake_broken") == ("an import of the framework that works (it raised here: "
                                      "RuntimeError: broken on import)",)


def test_a_runs_processes_share_a_probes_answer_where_a_folder_is_named(tmp_path, monkeypatch):
    """PROBE_CACHE_ENV: a second process (here the same one, its per-process cache cleared) is
    answered from the folder, without a child; without the folder, or with another import path
    (a fake of the framework), the child is asked."""
    (tmp_path / "spfake_counted.py").write_text(
        "import os\n"
        "def missing():\n"
        "    with open(os.environ['SPFAKE_CALLS'], 'a') as f:\n        f.write('x')\n"
        "    return ('spfake.api',)\n")
    calls = tmp_path / "calls"
    monkeypatch.setenv("SPFAKE_CALLS", str(calls))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PROBE_CACHE_ENV, str(tmp_path / "answers"))
    (tmp_path / "answers").mkdir()

    def asked() -> tuple[tuple[str, ...], int]:
        probe.cache_clear()
        answer = probe("spfake_counted")
        return answer, len(calls.read_text())

    assert asked() == (("spfake.api",), 1)
    assert asked() == (("spfake.api",), 1)  # from the folder
    assert [p.suffix for p in (tmp_path / "answers").iterdir()] == [".json"]  # no half-written file left
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    assert asked() == (("spfake.api",), 2)  # another import path: asked afresh
    monkeypatch.delenv(PROBE_CACHE_ENV)
    assert asked() == (("spfake.api",), 3)
    probe.cache_clear()


@pytest.mark.exhaustive("the fast tier runs every framework's cases, whose validate asks the same release range and "
                        "the same probe (releases.require) and is UNSUPPORTED where either fails, which their tests, "
                        "expecting PASS, would report; this names the API directly, at one probe (3-16 s) each")
@pytest.mark.parametrize("framework", sorted(COMPAT))
def test_every_integration_is_in_range_here_and_lacks_nothing(framework):
    """What the default suite installs is in every declared range, and each `missing()` finds
    every API its integration calls there (the release matrix asks the other releases)."""
    if not installed(framework):
        pytest.skip(f"{framework} is not installed")
    compat = COMPAT[framework]
    assert outside(importlib.import_module(compat).RELEASES) is None
    assert probe(compat) == ()


# `sp-harness CMD` for each CMD in turn, in one interpreter under Hidden's sitecustomize (each
# interpreter paid 3-5 s of imports for a command that takes milliseconds): a command's result and
# the processes it started (its own HIDDEN_STARTED file, inherited by the processes it starts).
# An interpreter that a command left running would serve a later command's children unrecorded:
# a command that must start none goes first.
_HIDDEN_BATCH = """
import contextlib, io, json, os, sys
from sp_harness.cli import main
for argv, started in json.loads(sys.argv[1]):
    os.environ["HIDDEN_STARTED"] = started
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


def _hidden_each(hidden: Hidden, argvs: list[list[str]]) -> list[tuple[subprocess.CompletedProcess, list[str]]]:
    started = [hidden.folder / f"started-batch-{i}" for i in range(len(argvs))]
    for path in started:
        path.touch()
    env = {k: v for k, v in os.environ.items() if k != "HIDDEN_ROOT_PID"}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden.folder / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    batch = json.dumps([[argv, str(path)] for argv, path in zip(argvs, started, strict=True)])
    proc = subprocess.run([sys.executable, "-c", _HIDDEN_BATCH, batch], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == len(argvs), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [(subprocess.CompletedProcess(argv, *json.loads(line)), path.read_text().split())
            for argv, line, path in zip(argvs, lines, started, strict=True)]


def test_a_framework_below_its_range_is_unsupported_before_any_rank_starts(tmp_path):
    if not installed("accelerate") or not installed("transformers"):
        pytest.skip("the HF Trainer integration is not installed")
    hidden = Hidden(tmp_path)  # hides nothing: records every process a command starts
    _fake_release(tmp_path / "site", "transformers", "4.44.2")
    reason = ("needs transformers 4.45.0 to 5.23.0 (the supported range), and transformers 4.44.2 is installed "
              "(pip install 'sp-harness[hf]' installs the tested releases)")
    (res, started), (listing, _), (env, _) = _hidden_each(
        hidden, [["check", "--case", "hf-trainer-llama", "--train-step"], ["list"], ["env", "--no-probe"]])
    assert f"UNSUPPORTED: case hf-trainer-llama {reason}" in res.stdout.splitlines(), res.stdout + res.stderr[-2000:]
    assert res.returncode == EXIT_OK
    assert started == [], f"processes started: {started}"

    assert listing.returncode == EXIT_OK, listing.stderr[-2000:]
    listed = {line.split()[0]: line for line in listing.stdout.splitlines() if line.strip()}
    assert listed["hf-trainer-llama"].endswith(f"unavailable: {reason}"), listed["hf-trainer-llama"]
    assert "unavailable" not in listed["ds-ulysses"]

    assert env.returncode == EXIT_OK, env.stderr[-2000:]
    hf = next(line for line in env.stdout.splitlines() if line.startswith("hf "))
    assert "4.44.2" in hf and hf.endswith("out of range: needs transformers 4.45.0 to 5.23.0 (the supported range), "
                                          "and transformers 4.44.2 is installed"), hf


def test_unavailable_names_the_range_for_every_case_of_the_framework(fakes):
    _fake_release(fakes, "megatron-core", "0.9.0")
    if not installed("megatron.core"):
        pytest.skip("megatron-core is not installed")
    assert installed_release("megatron-core") == "0.9.0"
    why = unavailable()
    names = FRAMEWORK_CASES["megatron.core"][1]
    assert all("megatron-core 0.9.0 is installed" in why[name] for name in names), {n: why.get(n) for n in names}
    assert not any("megatron-core" in why.get(name, "") for name in FRAMEWORK_CASES["yunchang"][1])


def test_the_release_table_renders_records(tmp_path):
    from sp_harness.suites.releases import table

    records = tmp_path / "hf-4.45.2.jsonl"
    rows = [{"case": "release-hf-x", "config": "ws=2", "releases": {"transformers": "4.45.2", "accelerate": "1.0.1"},
             "expected": "FAIL", "verdict": "FAIL", "caught_by": "reported loss", "pinned": "reported loss", "ok": True,
             "bug": "the bug", "source": "https://example.invalid/2", "reason": "", "repro": "", "env": "hf-4.45.2"}]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = table([records]).splitlines()
    assert lines[2] == "| `release-hf-x` | accelerate 1.0.1, transformers 4.45.2 | FAIL | FAIL | reported loss | yes |"
    assert lines[-1] == "| `release-hf-x` | the bug | https://example.invalid/2 |"


@pytest.mark.parametrize("name", ["release-hf-34191-mean-of-micro-batch-means", "release-hf-35207-loss-times-k-and-ranks",
                                  "release-hf-46731-label-smoother-per-micro-batch", "release-hf-5x-grads-divided-by-k-twice",
                                  "mcore-gpt-cp-step"])
def test_the_pinned_releases_are_the_fixed_ones(name):
    """On what the default suite pins, every release case expects PASS at its examples (its bug is
    fixed there) and pins the stage that catches it where it is not; the main job and the release
    matrix run them (`sp-harness releases`)."""
    from sp_harness.config.registry import get_case
    from sp_harness.judge.expect import expected_verdict

    case = get_case(name)
    if "unavailable" in case.description:
        pytest.skip(case.description)
    assert case.examples
    assert {expected_verdict(ex.config(name)) for ex in case.examples} == {"PASS"}
    if "release" in case.tags:
        assert case.killed_by and case.killed_by[0]


def test_api_gaps_names_each_missing_module_name_and_keyword():
    from sp_harness.cases.frameworks.releases import api_gaps

    gaps, modules = api_gaps([("json", "dumps", ("indent",)), ("json", "nope", ()), ("json", "dumps", ("zzz",)),
                              ("sp_harness_no_such_module", "a", ())])
    assert gaps == ["json.nope", "json.dumps(zzz=)",
                    "sp_harness_no_such_module (its import raised ModuleNotFoundError: "
                    "No module named 'sp_harness_no_such_module')"], gaps
    assert modules["json"] is not None and modules["sp_harness_no_such_module"] is None
