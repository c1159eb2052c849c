"""The HF Trainer integration's release range (sp_harness.cases.frameworks.hf.compat), without
ranks: the installed release is in range and has every API the step calls, its capabilities
agree with the loop shape they describe; a transformers below the range makes the Trainer's
cases UNSUPPORTED naming the release and the range; each release case's expected verdict
follows the releases that shipped its bugs. Releases outside the installed one are faked with a
distribution's metadata (a `.dist-info` ahead of site-packages), as tests/test_releases.py does:
the range is asked of the metadata, the framework code is the installed one."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from installed import skip_unless_installed

skip_unless_installed("transformers", "transformers is not installed (pip install -e '.[hf]')")
skip_unless_installed("accelerate", "accelerate is not installed (pip install -e '.[hf]')")

from sp_harness.cases.frameworks.hf import cases, compat  # noqa: E402
from sp_harness.cases.frameworks.releases import ShippedBug, installed_release, outside, require  # noqa: E402
from sp_harness.config.case import Unsupported  # noqa: E402

COMPAT = "sp_harness.cases.frameworks.hf.compat"


def _capabilities() -> dict:
    """compat's answers on the installed release, asked in a child interpreter (this process
    imports no framework: the rank processes' fork server of other tests must not inherit it)."""
    code = ("import json; from sp_harness.cases.frameworks.hf import compat as c; print(json.dumps(dict("
            "loop=c.trainer_loop(), missing=c.missing(), average=c.averages_tokens_across_devices(), "
            "loss_func=c.takes_compute_loss_func(), num_items=c.passes_num_items_in_batch(), "
            "device=c.batch_samples_take_device() if c.trainer_loop() != c.ACCUMULATE else None, "
            "log=sorted(c.log_parameters()), after_prepare=c.scheduler_after_prepare())))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_installed_release_is_in_range_and_has_every_api_the_step_calls():
    assert outside(compat.RELEASES) is None, outside(compat.RELEASES)
    found = _capabilities()
    note = f"transformers {installed_release('transformers')}, accelerate {installed_release('accelerate')}: {found}"
    assert found["missing"] == [], note
    assert found["loop"] in compat.LOOPS, note
    # what each loop shape implies of the rest: the capabilities describe one Trainer
    if found["loop"] == compat.ACCUMULATE:  # 4.45: no token count, hence nothing built on it
        assert not (found["num_items"] or found["average"] or found["loss_func"]), note
    else:
        assert found["num_items"] and found["average"] and found["loss_func"], note
        assert {"tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval"} <= set(found["log"]), note
    if found["loop"] == compat.RUN_EPOCH:  # 5.3 on: the split loop, on 5.x's APIs
        assert found["device"] and found["after_prepare"] and "learning_rate" in found["log"], note


def _fake_release(folder: Path, distribution: str, release: str) -> None:
    info = folder / f"{distribution.replace('-', '_')}-{release}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {release}\n")


@pytest.fixture
def fake_transformers(tmp_path, monkeypatch):
    """fake_transformers(release): the metadata of transformers `release` first on sys.path."""
    def fake(release: str) -> None:
        folder = tmp_path / release
        _fake_release(folder, "transformers", release)
        monkeypatch.syspath_prepend(str(folder))
        importlib.invalidate_caches()
        assert installed_release("transformers") == release

    return fake


def test_a_transformers_below_the_range_is_unsupported_naming_it(fake_transformers):
    fake_transformers("4.44.2")
    with pytest.raises(Unsupported) as caught:
        require(COMPAT, "hf-trainer-llama")
    reason = str(caught.value)
    assert reason.startswith("hf-trainer-llama needs transformers 4.45.0 to 5.23.0"), reason
    assert "transformers 4.44.2 is installed" in reason, reason


@pytest.mark.parametrize("release, failing", [
    ("4.45.2", {"34191", "35207", "46731"}),  # the mean of micro-batch means shows on every config
    ("4.46.3", {"46731"}),
    ("4.47.0", {"34191", "35207", "46731"}),  # x K x W on every config
    ("4.47.1", {"46731"}),
    ("5.3.0", {"34191", "35207", "46731"}),  # the first two at the grads, divided by K twice
    ("5.14.1", {"46731"}),
    ("5.15.0", set()),
    ("5.23.0", set()),
])
def test_each_release_case_expects_fail_where_a_bug_its_config_shows_was_shipped(fake_transformers, release, failing):
    fake_transformers(release)
    expected = {case.name.split("-")[2]: case.expect(None)
                for case in (cases.RELEASE_34191, cases.RELEASE_35207, cases.RELEASE_46731)}
    assert expected == {bug: "FAIL" if bug in failing else "PASS" for bug in ("34191", "35207", "46731")}
    grads_only = release.startswith("5.3")  # the one loss-stage bug there is the label smoother's
    assert cases.SHOWN_34191.stage_here() == cases.SHOWN_35207.stage_here() == (
        "grads before clipping" if grads_only else "reported loss")
    assert cases.SHOWN_46731.stage_here() == "reported loss"


# its config shows the 4.4x accumulation bugs too (uneven micro-batches, K = 3): the release matrix
# found it FAILing 4.47.0 at the reported loss where it had been declared to PASS there
@pytest.mark.parametrize("release, stage", [
    ("4.45.2", "reported loss"), ("4.46.3", None), ("4.47.0", "reported loss"), ("4.47.1", None), ("5.1.0", None),
    ("5.2.0", "grads before clipping"), ("5.3.0", "grads before clipping"), ("5.5.3", "grads before clipping"),
    ("5.5.4", None), ("5.23.0", None)])
def test_the_grads_divided_twice_case_expects_fail_on_5_2_to_5_5_3_and_where_the_4_4x_bugs_show(
        fake_transformers, release, stage):
    fake_transformers(release)
    assert cases.RELEASE_GRADS_DIVIDED_TWICE.expect(None) == ("FAIL" if stage else "PASS")
    assert cases.SHOWN_GRADS_DIVIDED_TWICE.stage_here() == (stage or "grads before clipping")


def test_the_registered_pins_are_the_installed_releases_stages():
    # killed_by is read at registration, from the release this process has installed
    for case, bug in ((cases.RELEASE_34191, cases.SHOWN_34191), (cases.RELEASE_35207, cases.SHOWN_35207),
                      (cases.RELEASE_GRADS_DIVIDED_TWICE, cases.SHOWN_GRADS_DIVIDED_TWICE),
                      (cases.RELEASE_46731, cases.SHOWN_46731)):
        assert case.killed_by == (bug.stage_here(),), case.name


def test_a_bug_shown_with_another_must_be_of_the_same_distribution():
    other = ShippedBug(distribution="accelerate", first="0.1.0", fixed="0.2.0", stage="grad", summary="s",
                       source="https://example.org/bug")
    with pytest.raises(ValueError, match="must be of transformers, got accelerate"):
        cases.shown_with(cases.MEAN_OF_MEANS_BUG, other)
