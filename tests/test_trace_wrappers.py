"""Localisation through wrappers: DDP, megatron's Float16Module and DeepSpeed's engine name every
module "module.<name>"; the trace strips the prefix the declared param mapping shows, so the
sharded modules line up with the reference's by name (before, none did, and every grad failure
was placed "in the grad sync")."""

import torch
from torch import nn

from sp_harness.capture.trace import Recorder
from sp_harness.config.case import ParamSpec
from sp_harness.step.params import LocalParam, wrapper_prefix


class Wrapper(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _params(model, prefix):
    return [LocalParam(prefix + n, p, ParamSpec(ref_name=n)) for n, p in model.named_parameters()]


def test_the_prefix_is_read_from_the_declared_mapping():
    inner = _model()
    assert wrapper_prefix(_params(inner, "module.")) == "module."
    assert wrapper_prefix(_params(inner, "")) == ""
    # names that do not end in their reference names, or disagree, give no prefix
    mixed = _params(inner, "module.")[:1] + _params(inner, "other.")[1:]
    assert wrapper_prefix(mixed) == ""


def test_wrapped_modules_line_up_with_the_reference():
    ref, inner = _model(), _model()
    wrapped = Wrapper(inner)
    got = Recorder(wrapped, prefix=wrapper_prefix(_params(inner, "module.")))
    want = Recorder(ref)
    x = torch.randn(3, 4, requires_grad=True)
    wrapped(x).sum().backward()
    ref(x.detach().requires_grad_()).sum().backward()
    assert list(got.forward) == list(want.forward) == ["0", "1", "2"]
    assert list(got.backward) == list(want.backward)
    for name in want.forward:
        torch.testing.assert_close(got.forward[name], want.forward[name])
