"""A property test pointed at a broken case, run by tests/test_shrink.py in a subprocess to show
what a user sees: hypothesis shrinks the failure to a minimal config with a one-line repro."""

import os

from hypothesis import given, note, settings
from hypothesis import strategies as st

from sp_harness.config.strategies import gpt_configs
from sp_harness.report.result_text import format_result


@settings(max_examples=40, database=None, deadline=None)
@given(data=st.data())
def test_broken_case_matches_reference(sp_check, data):
    config = data.draw(gpt_configs(os.environ["SP_DEMO_CASE"], max_world_size=3, max_dp=1, max_steps=1,
                                   dtype_choices=st.just("float64")), label="config")
    res = sp_check(config)
    note(format_result(res))
    assert res.verdict in ("PASS", "UNSUPPORTED"), f"{res.reason.splitlines()[0]}\nrepro: {res.config.repro()}"
