"""User-style case file for the pool's failure paths: a rank that raises, hangs, desyncs or crashes.

Loaded as `tests/faulty_cases.py:NAME`, the way a user verifies their own implementation.
"""

# These cases change no process-wide state: they share the built-in cases' rank processes
# (Case.isolation), which keeps the suite from starting a pool per case.

import ctypes
import time

import torch
import torch.distributed as dist

from sp_harness.cases.dtensor_plans import SEED_MLP
from sp_harness.config.case import Case, Layout, Sharded, Unsupported


def _shard_raising(model, ctx):
    if ctx.rank == 1:
        raise RuntimeError("boom on purpose in rank 1")
    dist.barrier()  # the others block, as real ranks would
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


def _raise_on_rank_1(module, args):
    raise RuntimeError("boom on purpose in rank 1's forward")


def _shard_raising_in_forward(model, ctx):
    # the model under test raises in its first forward on rank 1: a crash while it steps
    if ctx.rank == 1:
        model.register_forward_pre_hook(_raise_on_rank_1)
    return _replicated(model, ctx)


def _shard_hanging(model, ctx):
    if ctx.rank == 1:
        time.sleep(3600)
    return Sharded(module=model, input_layout=Layout(seq_dim=0, seq_sharded=False),
                   output_layout=Layout(seq_dim=0, seq_sharded=False), replicated=("*",))


def _shard_desync(model, ctx):
    # rank 0 all-reduces 4 floats while rank 1 all-gathers 8: a collective mismatch
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        out = [torch.empty(8) for _ in range(ctx.world_size)]
        dist.all_gather(out, torch.ones(8))
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


def _shard_desync_sizes(model, ctx):
    # the same collective, different sizes: rank 0 all-reduces 4 floats, rank 1 8 (gloo may hang
    # or abort on it; the driver must say desync either way)
    dist.all_reduce(torch.ones(4 if ctx.rank == 0 else 8))
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


def _shard_desync_unannounced(model, ctx):
    # rank 0 all-reduces (announced); rank 1 enters a barrier, which the accounting does not
    # count or announce: only the stall rule (both ranks stopped in c10d, counts 1 vs 0) sees it
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.barrier()
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


def _shard_segfault(model, ctx):
    if ctx.rank == 1:
        ctypes.string_at(0)  # a real invalid read in native code, as a broken extension would make
    dist.barrier()  # the others block, as real ranks would
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


def _shard_unsupported_late(model, ctx):
    raise Unsupported("found out on the rank, before any collective")


def _replicated(model, ctx):
    # no sharding at all: every rank runs the whole model on the whole input
    return Sharded(module=model, input_layout=Layout(seq_dim=0, seq_sharded=False),
                   output_layout=Layout(seq_dim=0, seq_sharded=False), replicated=("*",))


def _shard_littering(model, ctx):
    # as a framework making temp dirs at import does (wandb, under torchtitan), never removed
    import tempfile

    tempfile.mkdtemp(suffix="-litter")
    return _replicated(model, ctx)


def _variant(name, shard):
    return Case(isolation="shared", name=name, description=name, build_reference=SEED_MLP.build_reference, make_batch=SEED_MLP.make_batch,
                loss_sum=SEED_MLP.loss_sum, tokens=SEED_MLP.tokens, shard=shard, defaults=SEED_MLP.defaults,
                input_layout=SEED_MLP.input_layout)


RAISING = _variant("raising", _shard_raising)
RAISING_IN_FORWARD = _variant("raising-in-forward", _shard_raising_in_forward)
HANGING = _variant("hanging", _shard_hanging)
DESYNC = _variant("desync", _shard_desync)
DESYNC_SIZES = _variant("desync-sizes", _shard_desync_sizes)
DESYNC_UNANNOUNCED = _variant("desync-unannounced", _shard_desync_unannounced)
SEGFAULT = _variant("segfault", _shard_segfault)
UNSUPPORTED_LATE = _variant("unsupported-late", _shard_unsupported_late)
REPLICATED = _variant("replicated", _replicated)
LITTERING = _variant("littering", _shard_littering)
