"""Localisation through wrappers: DDP, megatron's Float16Module and DeepSpeed's engine name every
module "module.<name>"; the trace strips the prefix the declared param mapping shows, so the
sharded modules line up with the reference's by name (before, none did, and every grad failure
was placed "in the grad sync"). And through keyword inputs: HF attention takes `hidden_states=`,
and a module whose input gets no grad where the reference's has one is a divergence."""

import torch
from torch import nn

from sp_harness.capture.trace import Recorder, Trace
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


class _Attn(nn.Module):
    """HF-style attention, called with `hidden_states=`; `detached`: its exchange returns a
    tensor cut from its input (DeepSpeed#8491's all-to-all under torch.compile)."""

    def __init__(self, detached: bool):
        super().__init__()
        self.q, self.o, self.detached = nn.Linear(4, 4), nn.Linear(4, 4), detached

    def forward(self, hidden_states, scale=None):
        q = self.q(hidden_states)
        return self.o(torch.tanh(q.detach() if self.detached else q))


class _Layer(nn.Module):
    def __init__(self, detached: bool = False):
        super().__init__()
        self.norm, self.self_attn, self.mlp = nn.LayerNorm(4), _Attn(detached), nn.Linear(4, 4)

    def forward(self, x):
        x = x + self.self_attn(hidden_states=self.norm(x), scale=2.0)
        return x + self.mlp(x)


def _traced(model):
    torch.manual_seed(1)
    for p in model.parameters():
        nn.init.normal_(p)
    rec = Recorder(model)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    model.double()(x).pow(2).sum().backward()
    return rec


def test_a_keyword_input_is_traced_and_no_grad_where_the_reference_has_one_is_named():
    from sp_harness.compare.divergence import first_divergence
    ref, got = _traced(nn.Sequential(_Layer(), _Layer())), _traced(nn.Sequential(_Layer(), _Layer(detached=True)))
    assert "1.self_attn" in ref.backward  # its input came as hidden_states=
    assert "1.self_attn" not in got.backward and "1.self_attn" in got.inputs  # needed one, got none
    d = first_divergence(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64,
                         seq_len=3, seq_shards=(3,), tp_rank=0, failed_kind="grad")
    # the last layer's attention comes first in backward; the layer around it got a grad
    # (through the residual), wrong: before, the layer was named
    assert (d.phase, d.module) == ("backward", "1.self_attn"), d
    assert "first diverging module: 1.self_attn (no input grad at all, backward" in d.describe()
    d = first_divergence(step=0, rank=0, sharded=ref, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64,
                         seq_len=3, seq_shards=(3,), tp_rank=0, failed_kind="grad")
    assert d.phase == "none"


def test_at_dp_2_a_rank_s_traced_tensors_line_up_with_its_replica_s_rows():
    from sp_harness.compare.divergence import Replica, first_divergence
    g = torch.Generator().manual_seed(3)
    ref_out = {n: torch.randn(4, 12, 8, dtype=torch.float64, generator=g) for n in ("emb", "attn", "mlp")}
    ref_grad = {n: torch.randn(4, 12, 8, dtype=torch.float64, generator=g) for n in ("mlp", "attn")}
    ref_grad["rope"] = torch.randn(12, 8, dtype=torch.float64, generator=g)  # no batch dim: shared by the rows
    ref = Trace(forward=ref_out, backward=ref_grad, order=list(ref_out))
    mine = (slice(2, 4), slice(6, 12))  # DP rank 1's sequences, SP rank 1's half of them
    out = {n: t[mine].clone() for n, t in ref_out.items()}
    out["attn"][0, 0, 0] += 1.0  # another replica's sequence, say
    grads = {n: 2.0 * t[mine] for n, t in ref_grad.items() if n != "rope"}  # a replica's mean: 2x the global's
    grads["rope"] = ref_grad["rope"] * 0.5  # a replica's share: not comparable
    right = {n: t[mine] for n, t in ref_out.items()}
    kw = dict(step=0, rank=3, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64, seq_len=12,
              seq_shards=(6, 6), tp_rank=1)
    replica = Replica(dp=2, dp_rank=1, batch_dim=0, grad_scale=2.0)
    d = first_divergence(**kw, sharded=Trace(forward=out, order=list(out)), failed_kind="forward", replica=replica)
    assert (d.phase, d.module) == ("forward", "attn"), d.describe()
    # before, no traced tensor had the reference's rows: nothing could be localised
    d = first_divergence(**kw, sharded=Trace(forward=out, order=list(out)), failed_kind="forward")
    assert d.phase == "unaligned" and "(2, 6, 8) is neither the reference's (4, 12, 8)" in d.note
    d = first_divergence(**kw, sharded=Trace(forward=right, backward=grads, order=list(out)), failed_kind="grad",
                         replica=replica)
    assert d.phase == "none", d.describe()  # the scaled input grads agree; rope's share is not judged
    grads["mlp"] = grads["mlp"] * 1.5
    d = first_divergence(**kw, sharded=Trace(forward=right, backward=grads, order=list(out)), failed_kind="grad",
                         replica=replica)
    assert (d.phase, d.module) == ("backward", "mlp"), d.describe()


class _Lookup(nn.Module):
    """A TP-sharded module (skipped by name) whose output is a DTensor of `placement`, or a plain
    tensor where `placement` is None."""

    def __init__(self, mesh, placement):
        super().__init__()
        self.mesh, self.placement = mesh, placement

    def forward(self, x):
        from torch.distributed.tensor import DTensor
        return x if self.placement is None else DTensor.from_local(x, self.mesh, [self.placement])


def test_a_skipped_module_s_dtensor_output_is_traced_where_no_placement_is_partial(tmp_path):
    # torchtitan#3468: the vocab-parallel embedding holds a TP-sharded weight, so it was skipped,
    # yet its output's placements say what its local piece is: a Replicate one is the whole tensor
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.ModuleDict({k: _Lookup(mesh, p) for k, p in
                               (("replicate", Replicate()), ("partial", Partial()), ("plain", None))})
        rec = Recorder(model, skip=frozenset(model.keys()))
        for m in model.values():
            m(torch.randn(2, 3))
        assert list(rec.forward) == ["replicate"] and type(rec.forward["replicate"]) is torch.Tensor
    finally:
        dist.destroy_process_group()


def test_a_declared_whole_output_is_traced_and_its_input_grad_is_not():
    # Sharded.whole_outputs (torchtitan's spmd_types: plain params, the output type declared): the
    # module holds TP-sharded params, yet its output is complete, so it is compared; its input
    # grad may still be a piece, so it is not
    model = _model()
    rec = Recorder(model, skip=frozenset({"0", "2"}), outputs_only=frozenset({"2"}))
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    assert list(rec.forward) == ["1", "2"]
    assert list(rec.backward) == ["1"]
