"""The Megatron mappings on real gloo ranks, against single-device computations.

What the engine's end-to-end checks do not isolate: each uneven sequence collective's forward
and backward at tp=3 with sizes (4, 4, 2) and (0, 6, 4), on the seq dim of both layouts
([s, b, h]: dim 0, [b, s, h]: dim 1). Every rank builds all ranks' tensors from one seed, so
it can compute the single-device answer itself. Plus the cheap, process-free checks of the
cases' validation and of the mutants' one-piece structure.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import traceback

import pytest
import torch

TP = 3
SIZES = [(4, 4, 2), (0, 6, 4)]


def _global(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _full_shape(dim, n):
    return (n, 2, 3) if dim == 0 else (2, n, 3)


def _check_rank(rank: int) -> None:
    import torch.distributed as dist

    from sp_harness.cases.megatron import mappings as mp
    from sp_harness.config.shards import shard

    group = dist.group.WORLD
    for sizes in SIZES:
        n = sum(sizes)
        for dim in (0, 1):
            shape = _full_shape(dim, n)
            tag = f"sizes={sizes} dim={dim}"

            # gather_from_sp: forward all-gather, backward reduce-scatter (sum of all ranks' grads)
            x_full = _global(shape, 1)
            x = shard(x_full, dim, sizes, rank).clone().requires_grad_()
            y = mp.gather_from_sp(x, dim, sizes, group)
            assert torch.equal(y, x_full), f"gather forward {tag}"
            grads = [_global(shape, 10 + r) for r in range(TP)]
            y.backward(grads[rank])
            want = shard(sum(grads), dim, sizes, rank)
            torch.testing.assert_close(x.grad, want, rtol=1e-14, atol=1e-14, msg=f"gather backward {tag}")

            # reduce_scatter_to_sp: forward sum + keep my shard, backward all-gather
            ys = [_global(shape, 20 + r) for r in range(TP)]
            y_in = ys[rank].clone().requires_grad_()
            out = mp.reduce_scatter_to_sp(y_in, dim, sizes, group)
            torch.testing.assert_close(out, shard(sum(ys), dim, sizes, rank), rtol=1e-14, atol=1e-14,
                                       msg=f"reduce-scatter forward {tag}")
            g_full = _global(shape, 30)
            out.backward(shard(g_full, dim, sizes, rank))
            assert torch.equal(y_in.grad, g_full), f"reduce-scatter backward {tag}"

            # scatter_to_sp: forward split, backward all-gather
            s_in = x_full.clone().requires_grad_()
            out = mp.scatter_to_sp(s_in, dim, sizes, group)
            assert torch.equal(out, shard(x_full, dim, sizes, rank)), f"scatter forward {tag}"
            out.backward(shard(g_full, dim, sizes, rank))
            assert torch.equal(s_in.grad, g_full), f"scatter backward {tag}"

    # copy_to_tp / reduce_from_tp
    zs = [_global((2, 5, 3), 40 + r) for r in range(TP)]
    z = zs[rank].clone().requires_grad_()
    out = mp.reduce_from_tp(z, group)
    torch.testing.assert_close(out, sum(zs), rtol=1e-14, atol=1e-14)
    out.backward(zs[0])
    assert torch.equal(z.grad, zs[0]), "reduce_from_tp backward must be the identity"
    z = zs[rank].clone().requires_grad_()
    out = mp.copy_to_tp(z, group)
    assert torch.equal(out, zs[rank]), "copy_to_tp forward must be the identity"
    out.backward(zs[rank])
    torch.testing.assert_close(z.grad, sum(zs), rtol=1e-14, atol=1e-14)


def _worker(rank: int, port: int, queue) -> None:
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, TP, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=TP)
        try:
            _check_rank(rank)
        finally:
            dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 - report everything to the driver
        queue.put((rank, traceback.format_exc()))


def test_uneven_seq_mappings_on_gloo_ranks():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, TP + 1, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in range(TP))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: tb for r, tb in results.items() if tb}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items()))


# ------------------------------------------------------------------ process-free checks


def _cfg(**kw):
    from sp_harness.config.check_config import CheckConfig

    return CheckConfig(**kw)


def test_validate_rejects_with_numbers():
    from sp_harness.config.case import Unsupported
    from sp_harness.config.registry import get_case

    sp = get_case("megatron-gpt-sp")
    with pytest.raises(Unsupported, match=r"tp\(5\) > num_heads\(4\)"):
        sp.validate(sp.resolve(_cfg(case=sp.name, world_size=5)))
    with pytest.raises(ValueError, match=r"num_heads\(5\) does not divide hidden\(32\)"):
        sp.validate(sp.resolve(_cfg(case=sp.name, num_heads=5)))
    ref = get_case("megatron-gpt-ref")
    with pytest.raises(Unsupported, match=r"tp\(2\)"):
        ref.validate(ref.resolve(_cfg(case=ref.name, world_size=4, dp=2)))
    # supported: uneven heads (5 over 2), zero-token ranks, zero-head ranks (4 over 3 = 2/2/0)
    sp.validate(sp.resolve(_cfg(case=sp.name, world_size=2, num_heads=5, hidden=40)))
    sp.validate(sp.resolve(_cfg(case=sp.name, world_size=3, seq_len=10, seq_shards=(0, 6, 4))))
    sp.validate(sp.resolve(_cfg(case=sp.name, world_size=3)))
    ref.validate(ref.resolve(_cfg(case=ref.name, world_size=2, dp=2)))


def test_each_mutant_swaps_one_piece():
    from sp_harness.cases.megatron import collective_mutants as megatron_collective_mutants
    from sp_harness.cases.megatron import mutants as megatron_mutants
    from sp_harness.cases.megatron.impl import CORRECT
    from sp_harness.config.case import Case

    mutants = [v for mm in (megatron_mutants, megatron_collective_mutants) for v in vars(mm).values()
               if isinstance(v, Case) and "mutant" in v.tags]
    assert len(mutants) >= 10
    names = {c.name for c in mutants}
    assert "mutant-sp-no-norm-grad-sync" in names
    for case in mutants:
        assert case.models_bug and case.source and case.twin, case.name
        impl = case.shard.__closure__  # the Impl the case was built from
        found = [c.cell_contents for c in impl if type(c.cell_contents) is type(CORRECT)]
        assert len(found) == 1, case.name
        diff = [f.name for f in dataclasses.fields(CORRECT)
                if getattr(found[0], f.name) is not getattr(CORRECT, f.name)]
        assert len(diff) in (1, 2), (case.name, diff)  # gather+reduce-scatter pairs swap 2
