"""User-style case file for the case API pieces frameworks need (tests/test_case_api.py):
DTensor outputs, non-tensor inputs prepared per rank, grads in `main_grad`, forward-only runs,
named process groups and once-per-process registries. Each correct case has a mutant beside it
whose bug the piece under test must expose.
"""

# These cases change no process-wide state: they share the built-in cases' rank processes
# (Case.isolation), which keeps the suite from starting a pool per case.

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from sp_harness import Batch, Case, Layout, Sharded

WIDTH = 6

# --------------------------------------------------------------- DTensor outputs


class Head(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.body, self.head = torch.nn.Linear(WIDTH, 12), torch.nn.Linear(12, out)

    def forward(self, x):  # (S, WIDTH) -> (S, out)
        return self.head(torch.tanh(self.body(x)))


def _mislabel(module, args, out):
    """Re-wraps the output's local piece as if it were a sequence shard (a wrong from_local)."""
    return DTensor.from_local(out.to_local(), out.device_mesh, [Shard(0)], run_check=False)


def _head_reference(cfg):
    torch.manual_seed(cfg.seed)
    return Head(cfg.vocab).double()


def _regression_batch(cfg, step, gen):
    return (torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(cfg.seq_len, cfg.vocab, generator=gen, dtype=torch.float64))


def _dtensor_head(seq_sharded, *, mislabel=False, split=False):
    def shard(model, ctx):
        # the head's output stays a DTensor, Shard(-1): a vocab slice per rank under to_local()
        head = ColwiseParallel(input_layouts=Shard(0), use_local_output=False) if seq_sharded else \
            ColwiseParallel(use_local_output=False)
        plan = {"head": head}
        module = parallelize_module(model, ctx.device_mesh, plan)
        layout = Layout(seq_dim=0, seq_sharded=seq_sharded)

        def sync_grads():  # the body is plain and replicated: under SP its grads are per-token partial
            if seq_sharded:
                for p in module.body.parameters():
                    dist.all_reduce(p.grad, group=ctx.groups["sp"])

        out_layout = Layout(seq_dim=0, seq_sharded=False, split_dim=-1) if split else layout
        if mislabel:
            module.register_forward_hook(_mislabel)
        return Sharded(module=module, input_layout=layout,
                       output_layout=out_layout, replicated=("*",), sync_grads=sync_grads)

    return shard


def _head_case(name, shard):
    return Case(isolation="shared", name=name, description=name, build_reference=_head_reference, make_batch=_regression_batch,
                shard=shard, loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda tgt: tgt.shape[0],
                defaults=dict(seq_len=6, vocab=8))


DTENSOR_HEAD = _head_case("dtensor-head", _dtensor_head(False))
DTENSOR_HEAD_SP = _head_case("dtensor-head-sp", _dtensor_head(True))
DTENSOR_HEAD_MISLABELLED = _head_case("dtensor-head-mislabelled", _dtensor_head(False, mislabel=True))
SPLIT_WITHOUT_LOCAL_LOSS = _head_case("split-without-local-loss", _dtensor_head(False, split=True))

# --------------------------------------------------- non-tensor inputs, forward-only


@dataclasses.dataclass(frozen=True)
class KeepSpec:
    """Which positions count: p with p % period != phase; positions start at `start`."""

    period: int
    phase: int
    start: int = 0

    def keep(self, n, dtype):
        positions = torch.arange(self.start, self.start + n)
        return ((positions % self.period) != self.phase).to(dtype).unsqueeze(-1)


class BadTanh(torch.autograd.Function):
    """tanh with a wrong derivative (1 - y instead of 1 - y**2): a bug only backward sees."""

    @staticmethod
    def forward(fctx, x):
        y = torch.tanh(x)
        fctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(fctx, grad):
        (y,) = fctx.saved_tensors
        return grad * (1 - y)


class Masked(torch.nn.Module):
    def __init__(self, bad_backward=False):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 10), torch.nn.Linear(10, WIDTH)
        self.bad_backward = bad_backward

    def forward(self, x, spec):  # (S, WIDTH), KeepSpec -> (S, WIDTH)
        h = self.up(x)
        h = BadTanh.apply(h) if self.bad_backward else torch.tanh(h)
        return self.down(h) * spec.keep(x.shape[0], x.dtype)


def _masked_reference(cfg):
    torch.manual_seed(cfg.seed)
    return Masked().double()


def _masked_batch(cfg, step, gen):
    x = torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
    return Batch(inputs={"x": x, "spec": KeepSpec(period=3, phase=step % 3)},
                 target=torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64))


def _sum_over_tp(module, group):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _masked_shard(*, offset=True, bad_backward=False):
    def shard(model, ctx):
        if bad_backward:
            model.bad_backward = True

        def prepare(inputs, ctx):  # this rank's positions start at its offset in the sequence
            start = sum(ctx.seq_shards[:ctx.tp_rank]) if offset else 0
            return dict(inputs, spec=dataclasses.replace(inputs["spec"], start=start))

        return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                       replicated=("*",), prepare_inputs=prepare,
                       sync_grads=lambda: _sum_over_tp(model, ctx.groups["sp"]))

    return shard


def _masked_case(name, shard):
    return Case(isolation="shared", name=name, description=name, build_reference=_masked_reference, make_batch=_masked_batch,
                shard=shard, loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda tgt: tgt.shape[0],
                defaults=dict(seq_len=7))


MASKED = _masked_case("masked", _masked_shard())
MASKED_NO_OFFSET = _masked_case("masked-no-offset", _masked_shard(offset=False))
MASKED_BAD_BACKWARD = _masked_case("masked-bad-backward", _masked_shard(bad_backward=True))

# ------------------------------------------------------------- grads in main_grad


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 10), torch.nn.Linear(10, WIDTH)

    def forward(self, x):  # (S, WIDTH) -> (S, WIDTH)
        return self.down(torch.tanh(self.up(x)))


def _mlp_reference(cfg):
    torch.manual_seed(cfg.seed)
    return MLP().double()


def _mlp_batch(cfg, step, gen):
    return (torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64))


def _accumulate_into_main_grad(p):  # megatron-core's DDP hook: the grad moves into the buffer
    p.main_grad.add_(p.grad)
    p.grad = None


def _main_grad_shard(*, main_grad=True, synced=True):
    def shard(model, ctx):
        if main_grad:
            for p in model.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)

        def sync_grads():
            if synced:
                for p in model.parameters():
                    dist.all_reduce(p.main_grad if main_grad else p.grad, group=ctx.groups["sp"])

        return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                       replicated=("*",), sync_grads=sync_grads, grad_attr="main_grad" if main_grad else "grad")

    return shard


def _mlp_case(name, shard, **defaults):
    return Case(isolation="shared", name=name, description=name, build_reference=_mlp_reference, make_batch=_mlp_batch, shard=shard,
                loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda tgt: tgt.shape[0],
                defaults=dict(seq_len=8, **defaults))


MAIN_GRAD = _mlp_case("main-grad", _main_grad_shard())
MAIN_GRAD_UNSYNCED = _mlp_case("main-grad-unsynced", _main_grad_shard(synced=False))
PLAIN_GRAD = _mlp_case("plain-grad", _main_grad_shard(main_grad=False))
FORWARD_ONLY_BY_DEFAULT = _mlp_case("forward-only-by-default", _main_grad_shard(synced=False), forward_only=True)

# ------------------------------------------------- named groups, framework registry

ROWS, COLS = ((0, 1), (2, 3)), ((0, 2), (1, 3))


class GlobalSum(torch.autograd.Function):
    """Sum over the whole sequence, reduced over `groups` in turn (2 x 2: row then column). The
    loss is the sum of every rank's share, so the backward sums the grads the same way."""

    @staticmethod
    def forward(fctx, x, groups):
        fctx.groups, fctx.rows = groups, x.shape[0]
        total = x.sum(0)
        for g in groups:
            dist.all_reduce(total, group=g)
        return total

    @staticmethod
    def backward(fctx, grad):
        grad = grad.contiguous()
        for g in fctx.groups:
            dist.all_reduce(grad, group=g)
        return grad.unsqueeze(0).expand(fctx.rows, *grad.shape), None


class Centered(torch.nn.Module):
    """An MLP whose output is centred over the whole sequence: a sequence-wide statistic."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 10), torch.nn.Linear(10, WIDTH)
        self.groups, self.seq_len = (), 0

    def forward(self, x):  # (S, WIDTH) -> (S, WIDTH)
        y = self.down(torch.tanh(self.up(x)))
        total = GlobalSum.apply(y, self.groups) if self.groups else y.sum(0)
        return y - total / (self.seq_len or x.shape[0])


def _centered_reference(cfg):
    torch.manual_seed(cfg.seed)
    return Centered().double()


def _registry():
    os.environ["CASEAPI_ONCE_CALLS"] = str(int(os.environ.get("CASEAPI_ONCE_CALLS", "0")) + 1)
    return {"made_by": os.getpid()}


def _grid_shard(*, both=True):
    def shard(model, ctx):
        registry = ctx.once(("caseapi-registry", ctx.world_size), _registry)
        if os.environ["CASEAPI_ONCE_CALLS"] != "1" or registry["made_by"] != os.getpid():
            raise RuntimeError(f"ctx.once ran its function {os.environ['CASEAPI_ONCE_CALLS']} times")
        row, col = ctx.new_groups("row", ROWS), ctx.new_groups("col", COLS)
        if ctx.new_groups("row", ROWS) is not row or ctx.groups["row"] is not row:
            raise RuntimeError("new_groups made a second group for one partition")
        seen = os.environ.setdefault("CASEAPI_ROW_GROUP", str(id(row)))
        if seen != str(id(row)):
            raise RuntimeError("a later job on this pool got new groups for the same partition")
        model.groups, model.seq_len = (row, col) if both else (row,), sum(ctx.seq_shards)

        def sync_grads():
            for p in model.parameters():
                for g in (row, col):
                    dist.all_reduce(p.grad, group=g)

        return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                       replicated=("*",), sync_grads=sync_grads)

    return shard


def _grid_case(name, shard):
    return Case(isolation="shared", name=name, description=name, build_reference=_centered_reference, make_batch=_mlp_batch,
                shard=shard, loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda tgt: tgt.shape[0],
                defaults=dict(seq_len=9))


GRID = _grid_case("grid-groups", _grid_shard())
GRID_ROW_ONLY = _grid_case("grid-groups-row-only", _grid_shard(both=False))
