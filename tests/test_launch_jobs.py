"""Rank jobs are functions: the driver names them for the ranks ("module:function") and refuses,
before any rank starts, a function the ranks could not import by that name."""

from __future__ import annotations

import sys

import pytest

from sp_harness.launch.pool import RankPool
from sp_harness.launch.wire import job_ref
from sp_harness.launch.worker import health_check, resolve


def _module_level(payload: int) -> int:
    return payload


def test_a_module_level_function_is_named_by_module_and_name():
    assert job_ref(health_check) == "sp_harness.launch.worker:health_check"
    assert resolve(job_ref(_module_level)) is _module_level
    assert job_ref(sys.exit) == "sys:exit"


def _nested():
    def inner(payload):
        return payload

    return inner


class _Holder:
    def method(self, payload):
        return payload


@pytest.mark.parametrize("fn", [lambda p: p, _nested(), _Holder().method, _Holder.method],
                         ids=["lambda", "nested", "bound-method", "method"])
def test_a_function_the_ranks_cannot_import_is_refused(fn):
    with pytest.raises((TypeError, ValueError), match="module-level function"):
        job_ref(fn)


def test_the_pool_refuses_it_before_starting_ranks():
    pool = RankPool(2)
    with pytest.raises(ValueError, match="module-level function"):
        pool.run(_nested(), None, timeout_s=5, label="nested")
    assert not pool.alive and pool.num_starts == 0
