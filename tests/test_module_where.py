"""Where a crash happened in the model: the innermost module running, in forward or backward
(sp_harness.capture.module_where), carried by a raising rank's reply and by each announced
collective, so a crash kill names a module where its traceback names only autograd or gloo."""

import pytest
import torch
from torch import nn

from sp_harness.capture.module_where import ModuleWhere
from sp_harness.launch.failure import RankError, mark_module, module_of
from sp_harness.launch.wire import Collective


class _Fails(nn.Module):
    def __init__(self, in_backward: bool):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.in_backward = in_backward

    def forward(self, x):
        y = self.inner(x)
        return _RaiseInBackward.apply(y) if self.in_backward else y.view(-1, 3)  # 4 x 4 has no rows of 3


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


def _model(in_backward: bool):
    return nn.Sequential(nn.Linear(4, 4), _Fails(in_backward), nn.Linear(4, 4))


@pytest.mark.parametrize("in_backward,where", [(False, "1 (forward)"), (True, "1 (backward)")])
def test_the_innermost_running_module_is_named_in_its_phase(in_backward, where):
    model = _model(in_backward)
    phase = ["forward"]
    x = torch.randn(4, 4, requires_grad=True)
    with ModuleWhere(model, lambda: phase[0]) as tracker:
        with pytest.raises(RuntimeError) as raised:
            out = model(x)
            phase[0] = "backward"
            out.sum().backward()
        # in forward: inner has returned, its parent raised; in backward: the parent's own
        # Function, after the last module's backward and before inner's
        assert tracker.now() == where
        mark_module(raised.value, tracker.now())
    assert module_of(raised.value) == where
    assert tracker.now() == ""  # the stack closed


def test_a_finished_pass_leaves_no_module_and_a_wrapper_prefix_is_stripped():
    inner = _model(in_backward=False)
    inner[1] = nn.Linear(4, 4)
    wrapped = nn.ModuleDict({"module": inner})
    phase = ["forward"]
    with ModuleWhere(wrapped, lambda: phase[0], prefix="module.") as tracker:
        seen = []
        inner[2].register_forward_pre_hook(lambda m, a: seen.append(tracker.now()))
        out = wrapped["module"](torch.randn(2, 4, requires_grad=True))
        assert tracker.now() == ""
        phase[0] = "backward"
        out.sum().backward()
        phase[0] = "grad_sync"
        assert seen == ["2 (forward)"] and tracker.now() == ""


def test_the_failure_lines_carry_the_module_and_the_last_collective():
    raised = RankError(rank=1, kind="raised", exc_type="RuntimeError", message="boom", module="blocks.0.attn (backward)")
    assert raised.headline() == "raised RuntimeError in blocks.0.attn (backward): boom"
    last = Collective(index=7, group_index=7, kind="all_to_all", nbytes=1536, group=(0, 1),
                      module="blocks.0.attn.dist_attn (forward)")
    died = RankError(rank=0, kind="signal", signal_name="SIGABRT", collective=last)
    assert died.headline() == ("killed by SIGABRT (its last collective: all_to_all of 1536 bytes on ranks 0,1 "
                               "(collective #7 of the job, #7 on that group), in blocks.0.attn.dist_attn (forward))")
