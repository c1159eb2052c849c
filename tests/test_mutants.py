"""The default battery kills every mutant in the catalogue, each by its pinned check and entry:
one test per mutant, so a change that blinds a check (a loosened tolerance, a skipped
comparison) or moves a kill to another check fails CI by name. A correct twin failing an entry
is a battery error, never a silent skip.

Each mutant's pin is declared where it is defined (`mutant(..., killed_by=(check, entry))`) and
read here from the registry. The fast tier runs each mutant's pinned entry alone (its twin passes it, the mutant fails it at
the pinned check); the full tier runs the battery from its first entry, so it also proves that no
earlier entry kills the mutant (a kill moving earlier is a change to review, not a blind check)."""

import pytest

from sp_harness.suites.battery import Battery, mutant_names


@pytest.fixture(scope="session")
def battery(sp_pool, tmp_path_factory):
    return Battery(sp_pool)


def test_catalogue_is_large_enough():
    assert len(mutant_names()) >= 12


def test_every_mutant_declares_a_pinned_killer():
    from sp_harness.config.registry import get_case
    from sp_harness.suites.battery import BATTERY

    entries = {e.name for e in BATTERY}
    for name in mutant_names():
        pin = get_case(name).killed_by
        assert len(pin) == 2 and all(pin), f"{name} declares no killed_by=(check, battery entry) where it is defined"
        assert pin[1] in entries, f"{name}: killed_by names battery entry {pin[1]!r}; entries: {sorted(entries)}"


@pytest.mark.parametrize("mutant", mutant_names())
def test_mutant_is_killed_by_its_pinned_check(battery, tier, mutant):
    from sp_harness.config.registry import get_case

    pinned = tuple(get_case(mutant).killed_by)
    outcome = battery.kill(mutant, only=pinned[1] if tier == "fast" else None)
    assert not outcome.twin_failures, outcome.detail
    assert outcome.status == "KILLED", f"{mutant} survived the default battery: {outcome.models_bug}"
    assert (outcome.killed_by, outcome.entry) == pinned, outcome.detail
