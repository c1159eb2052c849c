"""The default battery kills every mutant in the catalogue: one test per mutant, so a change that
blinds a check (a loosened tolerance, a skipped comparison) fails CI by name."""

import pytest

from harness.mutants import Battery, mutant_names


@pytest.fixture(scope="session")
def battery(sp_pool, tmp_path_factory):
    return Battery(sp_pool, work_dir=str(tmp_path_factory.mktemp("mutants")))


def test_catalogue_is_large_enough():
    assert len(mutant_names()) >= 12


@pytest.mark.parametrize("mutant", mutant_names())
def test_mutant_is_killed(battery, mutant):
    outcome = battery.kill(mutant)
    assert outcome.status == "KILLED", f"{mutant} survived the default battery: {outcome.models_bug}"
