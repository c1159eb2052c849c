"""DeepSpeed 0.19.8 DistributedAttention on an uneven sequence split (10 tokens over 3 ranks: 4/4/2), on gloo.

    .venv/bin/python docs/frameworks/repro/deepspeed_uneven_split.py

Measured (torch 2.13.0 CPU, gloo): a rank aborts in gloo's C++ ("op.preamble.length <= op.nbytes. 256 vs 128.
Received data size doesn't match expected size"): DeepSpeed's all_to_all_single uses implicit equal splits
over buffers whose sizes differ between ranks. On GPUs the same call is reported to return corrupted output
without an error (deepspeedai/DeepSpeed#7384; fix proposed in #7868, not in 0.19.8).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

SIZES = (4, 4, 2)
HEADS, HEAD_DIM = 6, 4


def attention(q, k, v):  # (B, S, h, d) -> (B, S, h, d)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class Local(torch.nn.Module):
    def forward(self, q, k, v):
        return attention(q, k, v)


def run(rank: int, world_size: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, sum(SIZES), HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    mine = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    dist_attn = DistributedAttention(Local(), dist.group.WORLD, scatter_idx=2, gather_idx=1)
    try:
        out = dist_attn(q[:, mine], k[:, mine], v[:, mine], 0)
        err = (out - attention(q, k, v)[:, mine]).abs().max().item()
        print(rank, "shape", tuple(out.shape), "max abs err vs unsharded", err, flush=True)
    except Exception as exc:  # noqa: BLE001
        print(rank, "raised", type(exc).__name__, str(exc)[:300], flush=True)


if __name__ == "__main__":
    mp.spawn(run, args=(len(SIZES),), nprocs=len(SIZES))
