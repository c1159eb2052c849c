"""A Megatron-style vocab-parallel LM head: column-parallel logits (each TP rank holds a slice of
the vocabulary) and a vocab-parallel cross entropy (all-reduce of the max, the sum of exps and
the target logit over the TP group), checked against a single-device reference.

    sp-harness check --case examples/vocab_parallel.py:VOCAB_LM --world-size 3   # vocab 10: 4/4/2

The output is described by `Layout(split_dim=-1)`: the logits are judged piece by piece, and the
case gives its own `local_loss` (every TP rank holds the whole loss, as Megatron's does).
`VOCAB_LM_PADDED` splits the vocabulary by explicit sizes; the two mutants show that a bug in the
vocab-parallel loss is caught.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_harness import Case, Layout, ParamSpec, Sharded

WIDTH = 6


class LM(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.body = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, vocab, bias=False)

    def forward(self, x):  # (B, S, WIDTH) -> (B, S, vocab)
        return self.head(torch.tanh(self.body(x)))


class CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, grad all-reduce backward."""

    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=fctx.group)
        return grad, None


class VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy of (N, V_local) logits whose vocab is split over `group`."""

    @staticmethod
    def forward(fctx, logits, target, start, group, reduce_max, in_place=False):
        logits_max = logits.max(dim=-1).values
        if reduce_max:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # in place, megatron-core overwrites its float32 logits (the model's output) with these
        logits = logits.sub_(logits_max.unsqueeze(-1)) if in_place else logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + logits.shape[-1])
        local_target = (target - start).masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        predicted = logits[rows, local_target].masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        fctx.save_for_backward(exp / sum_exp.unsqueeze(-1), outside, local_target)
        return sum_exp.log() - predicted

    @staticmethod
    def backward(fctx, grad):
        softmax, outside, local_target = fctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_target] -= (~outside).to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None, None, None


class VocabParallelLM(torch.nn.Module):
    def __init__(self, body, head, tp_group):
        super().__init__()
        self.body, self.head, self.tp_group = body, head, tp_group

    def forward(self, x):  # (B, S, WIDTH) -> (B, S, this rank's slice of the vocab)
        return self.head(CopyToTP.apply(torch.tanh(self.body(x)), self.tp_group))


def chunk_sizes(vocab, tp):  # torch.chunk's split: 10 over 3 is 4/4/2
    step = -(-vocab // tp)
    return tuple(max(0, min(step, vocab - i * step)) for i in range(tp))


def make_shard(split_sizes=chunk_sizes, *, reduce_max=True, loss_share=False, in_place=False):
    def shard(model, ctx):
        tp_group = ctx.groups["tp"]  # the named groups: "tp" ("sp", "cp"), "dp", "world"
        sizes = split_sizes(model.head.weight.shape[0], ctx.tp)
        start = sum(sizes[:ctx.tp_rank])
        head = torch.nn.Linear(WIDTH, sizes[ctx.tp_rank], bias=False, dtype=model.head.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(model.head.weight[start:start + sizes[ctx.tp_rank]])
        module = VocabParallelLM(model.body, head, tp_group)

        def local_loss(out, tgt, ctx):  # this replica's mean loss, whole on every TP rank
            losses = VocabParallelCE.apply(out.reshape(-1, out.shape[-1]), tgt.reshape(-1), start, tp_group,
                                           reduce_max, in_place)
            return losses.sum() / tgt.numel() / (ctx.tp if loss_share else 1)

        def sync_grads():  # DP averaging; TP grads are already whole (CopyToTP's all-reduce)
            if ctx.dp > 1:
                for p in module.parameters():
                    dist.all_reduce(p.grad, group=ctx.groups["dp"])
                    p.grad /= ctx.dp

        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
        out = Layout(seq_dim=1, batch_dim=0, seq_sharded=False, split_dim=-1, split_sizes=sizes)
        return Sharded(module=module, input_layout=io, output_layout=out, local_loss=local_loss,
                       sync_grads=sync_grads, params={"head.weight": ParamSpec(ref_name="head.weight", dim=0,
                                                                               sizes=sizes)},
                       replicated=("body.weight", "body.bias"))

    return shard


def reference(cfg):
    torch.manual_seed(cfg.seed)
    return LM(cfg.vocab).double()


def batch(cfg, step, gen):
    x = torch.randn(cfg.dp * cfg.batch, cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, cfg.vocab, (cfg.dp * cfg.batch, cfg.seq_len), generator=gen)


VOCAB_LM = Case(name="vocab-parallel-lm", description="column-parallel LM head + vocab-parallel cross entropy",
                build_reference=reference, make_batch=batch, shard=make_shard(),
                loss_sum=lambda out, tgt: F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1),
                                                          reduction="sum"),
                tokens=lambda tgt: tgt.numel(), input_layout=Layout(seq_dim=1, batch_dim=0),
                defaults=dict(seq_len=5, vocab=10))
VOCAB_LM_PADDED = dataclasses.replace(VOCAB_LM, name="vocab-parallel-lm-padded",
                                      shard=make_shard(lambda vocab, tp: (vocab - 2 * (tp - 1),) + (2,) * (tp - 1)))
# mutants: each rank shifts by its own max (the softmax over the whole vocab no longer normalises),
# and the "share of the loss" misreading (each TP rank returns loss / tp: its grads are tp times too small)
VOCAB_LM_NO_MAX_REDUCE = dataclasses.replace(VOCAB_LM, name="vocab-parallel-lm-no-max-reduce",
                                             shard=make_shard(reduce_max=False))
VOCAB_LM_LOSS_SHARE = dataclasses.replace(VOCAB_LM, name="vocab-parallel-lm-loss-share",
                                          shard=make_shard(loss_share=True))
# a loss that consumes the logits in place, as megatron-core's does: correct, and must PASS
VOCAB_LM_IN_PLACE_LOSS = dataclasses.replace(VOCAB_LM, name="vocab-parallel-lm-in-place-loss",
                                             shard=make_shard(in_place=True))
