"""The HF SP path's gloo shim for all_gather into outputs of different shapes
(sp_harness.cases.frameworks.hf.shims.gloo_uneven_all_gather), on real gloo processes: each
output holds exactly its member's tensor, as ProcessGroupNCCL's all_gather_v gives, on a subgroup
whose group ranks are not its global ranks; equal shapes take torch's own all_gather."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, results) -> None:
    from sp_harness.cases.frameworks.hf.shims import gloo_uneven_all_gather

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        group = dist.new_group([1, 2])
        gloo_uneven_all_gather()
        gloo_uneven_all_gather()  # idempotent
        if rank in (1, 2):
            mine = torch.full((2, 2 + rank), float(rank)) + torch.arange(2 + rank)
            out = [torch.zeros(2, 3), torch.zeros(2, 4)]
            dist.all_gather(out, mine, group=group)
            same = [torch.zeros(3), torch.zeros(3)]
            dist.all_gather(same, torch.full((3,), float(rank)), group=group)
            results[rank] = ([t.tolist() for t in out], [t.tolist() for t in same])
    finally:
        dist.destroy_process_group()


def test_uneven_all_gather_on_gloo_gives_each_members_tensor(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(3, str(tmp_path / "store"), results), nprocs=3, join=True)
    want = ([(torch.full((2, 3), 1.0) + torch.arange(3)).tolist(), (torch.full((2, 4), 2.0) + torch.arange(4)).tolist()],
            [[1.0] * 3, [2.0] * 3])
    assert results[1] == want and results[2] == want, dict(results)
