"""A hang is a rank that makes no progress, not a slow one (sp_harness.launch.activity.Liveness):
the rules on synthetic looks at /proc, then on real ranks (tests/progress_cases.py), a slow
correct check under the default timeout among them. Asserted: verdicts and which rule fired,
never how long anything took."""

import os
import pickle
import sys

import pytest

from sp_harness.config.check_config import DEFAULT_TIMEOUT_S, CheckConfig
from sp_harness.config.flags import docstrings
from sp_harness.judge.verdict import FAIL, PASS
from sp_harness.launch import activity
from sp_harness.launch.activity import CAP_FACTOR, CAP_FLOOR_S, LOOK_S, NO_PROGRESS_S, Activity, Liveness
from sp_harness.launch.failure import RankError, RankFailure

CASES = os.path.join(os.path.dirname(__file__), "progress_cases.py")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rule reads /proc")


def _looks(live: Liveness, since: float, until: float, seen_at) -> float | None:
    """Looks every LOOK_S after `since` up to `until` (`seen_at(t)`: rank -> Activity); the time
    of the look that called the job hung, None if none did."""
    t = since
    while t < until:
        t += LOOK_S
        if live.look(t, seen_at(t)):
            return t
    return None


def _idle(t: float) -> dict[int, Activity]:
    # as measured on a gloo rank hung in a collective: a background tick every few seconds, and
    # now and then a thread caught running
    return {0: Activity(running=int(t) % 7 == 0, cpu_ticks=100 + int(t) // 3),
            1: Activity(running=False, cpu_ticks=50 + int(t) // 4)}


def test_ranks_idle_for_the_window_are_hung_and_a_message_starts_it_over():
    live = Liveness(start=0.0, timeout_s=1e9)
    assert _looks(live, 0.0, NO_PROGRESS_S - LOOK_S, _idle) is None  # not yet a window of looks
    live.heard(NO_PROGRESS_S - 0.5)  # a rank spoke: what came before is no evidence of idleness
    assert _looks(live, NO_PROGRESS_S - 0.5, 2 * NO_PROGRESS_S - LOOK_S, _idle) is None
    assert _looks(live, 2 * NO_PROGRESS_S - LOOK_S, 4 * NO_PROGRESS_S, _idle) is not None
    assert live.fired == "no progress" and live.quiet_s >= NO_PROGRESS_S


def test_a_rank_that_computes_or_waits_to_run_is_never_hung():
    def computing(t):  # rank 1 asleep at every look (a thread blocked on its busy reference process)
        return {0: _idle(t)[0], 1: Activity(running=False, cpu_ticks=int(50 * t))}

    def starved(t):  # runnable at every look, and barely given the CPU (a loaded machine)
        return {0: _idle(t)[0], 1: Activity(running=True, cpu_ticks=int(t) // 10)}

    for seen_at in (computing, starved):
        live = Liveness(start=0.0, timeout_s=1e9)
        assert _looks(live, 0.0, 30 * NO_PROGRESS_S, seen_at) is None and live.fired == ""
    # without /proc there is no evidence: never called hung (the timeout still ends the wait)
    live = Liveness(start=0.0, timeout_s=1e9)
    assert _looks(live, 0.0, 30 * NO_PROGRESS_S, lambda t: None) is None


def test_the_first_step_sets_the_cap_below_the_hard_one(tmp_path):
    absent = str(tmp_path / "no-proc")  # the cap needs no look at /proc
    live = Liveness(start=0.0, timeout_s=1e9, proc=absent)
    assert live.cap_s is None and not live.stop(1e6, {0: 1})  # no step reported: the timeout alone
    live.progress(18.0, 1, 3)
    cap = CAP_FACTOR * 18.0 * 3
    assert live.cap_s == cap > CAP_FLOOR_S
    assert not live.stop(cap - 1.0, {0: 1}) and live.stop(cap, {0: 1}) and live.fired == "cap"
    assert f"ran past its cap of {cap:.0f} s" in live.cap_text() and "first step's 18.0 s" in live.cap_text()
    # a first step of milliseconds: the floor
    quick = Liveness(start=0.0, timeout_s=1e9, proc=absent)
    quick.progress(0.01, 1, 3)
    assert quick.cap_s == CAP_FLOOR_S and "the floor" in quick.cap_text()
    # a cap at or past the job's timeout never fires: the timeout does, with its own message
    capped = Liveness(start=0.0, timeout_s=cap, proc=absent)
    capped.progress(18.0, 1, 3)
    assert not capped.stop(cap + 1.0, {0: 1}) and capped.fired == ""


def test_a_hang_says_its_rule_before_the_ranks_and_keeps_it_across_processes():
    culprit = RankError(rank=1, kind="timeout", detail="asleep outside any collective",
                        traceback='  File "/u/case.py", line 7 in shard\n')
    waiting = RankError(rank=0, kind="timeout", detail="blocked in a collective",
                        traceback='  File "/t/torch/distributed/distributed_c10d.py", line 1 in barrier\n')
    hang = RankFailure("job", [waiting, culprit], 11.6, rule="no progress for 11 s (...)")
    assert hang.describe(with_traces=False) == (
        "job: no progress for 11 s (...): timed out after 11.6s; rank(s) 1 did not finish "
        "(rank(s) 0 blocked in a collective, waiting for them)")
    again = pickle.loads(pickle.dumps(hang))
    assert isinstance(again, RankFailure) and again.rule == hang.rule and again.culprits == [1]


def test_the_timeout_flags_help_states_the_rules_constants():
    help_text = docstrings(CheckConfig)["timeout_s"]
    for said in (f"no progress for {NO_PROGRESS_S:g} s", f"{CAP_FACTOR:g} x its steps",
                 f"at least {CAP_FLOOR_S:g} s", f"else {DEFAULT_TIMEOUT_S:g}"):
        assert said in help_text, (said, help_text)


@linux
@pytest.mark.exhaustive("10 s of the real window; the fast tier ends the same sleeping rank by the same rule at a "
                        "1 s window, and asserts its wording: test_a_rank_computing_in_silence_is_not_hung")
def test_a_rank_asleep_while_stepping_is_named_within_the_window(sp_check):
    # the suite's job timeout (120 s) is far off: only the no-progress rule ends this one soon
    res = sp_check(CheckConfig(case=f"{CASES}:ASLEEP", world_size=2))
    assert res.verdict == FAIL and res.crash_kind == "timeout" and res.first_check == "hang (timeout)", res.reason
    assert "no progress for" in res.reason and "rank 1 asleep outside any collective" in res.reason, res.reason
    culprit, waiting = res.rank_errors
    assert (culprit.rank, culprit.detail) == (1, "asleep outside any collective")
    assert waiting.rank == 0 and waiting.detail.startswith("blocked in")
    assert "_asleep" in res.error  # the culprit's stack, taken once it had stopped


@linux
def test_a_rank_computing_in_silence_is_not_hung(sp_check, monkeypatch):
    # a window of 1 s against 3 s of silent computation on rank 1 (progress_cases.BURN_S) while
    # rank 0 sleeps in a collective: rank 1's CPU is the only sign it is working; the same window
    # ends a rank asleep there, so the PASS is the rule telling the two apart, not a rule that
    # never fires
    monkeypatch.setattr(activity, "NO_PROGRESS_S", 1.0)
    res = sp_check(CheckConfig(case=f"{CASES}:BURNING", world_size=2, steps=1))
    assert res.verdict == PASS and res.crash_kind == "", res.reason
    res = sp_check(CheckConfig(case=f"{CASES}:ASLEEP", world_size=2, steps=1))
    assert res.verdict == FAIL and res.crash_kind == "timeout" and "no progress for" in res.reason, res.reason
    assert "rank 1 asleep outside any collective" in res.reason, res.reason
    assert [(e.rank, e.detail.split(" ")[0]) for e in res.rank_errors] == [(1, "asleep"), (0, "blocked")]


@linux
def test_a_rank_that_never_stops_computing_ends_at_its_cap(sp_check, monkeypatch):
    # rank 1 spins from its second step on: busy, so never idle; the cap its first step set ends
    # it (scaled down to 1 x the steps, floor 2 s, against the suite's 120 s timeout)
    monkeypatch.setattr(activity, "CAP_FACTOR", 1.0)
    monkeypatch.setattr(activity, "CAP_FLOOR_S", 2.0)
    res = sp_check(CheckConfig(case=f"{CASES}:SPINNING", world_size=2))
    assert res.verdict == FAIL and res.crash_kind == "timeout", res.reason
    assert "ran past its cap of" in res.reason and "first step's" in res.reason, res.reason
    assert res.rank_errors[0].rank == 1 and "_spinning" in res.error


@linux
@pytest.mark.exhaustive("81 s of a sleeping step; the fast tier runs the rules that let it pass: "
                        "test_a_rank_computing_in_silence_is_not_hung, test_the_first_step_sets_the_cap")
def test_a_correct_check_slower_than_the_old_flat_timeout_passes(sp_check, monkeypatch):
    # no timeout from the suite or the environment: the default, as a user's `sp-harness check`
    # gets it. Each step takes 27 s in 4.5 s pieces between collectives (progress_cases.SLOW),
    # as a realistic size's layers do: 81 s, past the old flat 30 s, with progress throughout
    monkeypatch.setattr("sp_harness.config.timeouts._session_timeout_s", None)
    monkeypatch.delenv("SP_HARNESS_TIMEOUT", raising=False)
    res = sp_check(CheckConfig(case=f"{CASES}:SLOW", world_size=2))
    assert res.config.timeout_s == DEFAULT_TIMEOUT_S
    assert res.verdict == PASS and res.crash_kind == "", res.reason
