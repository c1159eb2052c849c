"""Stage: config and step. Shared pieces of the built-in cases: GPT config from a
CheckConfig, batches, losses, the checks of a GPT config, the replicated-grad sync and the fields
every GPT case shares (`gpt_fields`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn import functional as F

from sp_harness.config.case import Batch, Layout, Training, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.shards import chunk_sizes
from sp_harness.reference.gpt import GPT, Attention, GPTConfig, build_gpt, token_loss_sum
from sp_harness.step.data import MarkovChain

T = TypeVar("T")

IGNORE_INDEX = -100
"""A target that carries no loss (F.cross_entropy's default ignore_index, as in HF and Megatron)."""
GPT_DEFAULTS: dict[str, Any] = dict(seq_len=12, hidden=32, ffn=64, num_heads=4, num_layers=2, vocab=64)
LocalLoss = Callable[[torch.Tensor, torch.Tensor, RankContext], torch.Tensor]
"""A `Sharded.local_loss`: (local output, local target, rank context) -> this rank's share."""
GPT_INPUT = Layout(seq_dim=1, batch_dim=0)
"""The GPT's tokens and targets: (B, S)."""


def known(value: T | None, field: str) -> T:
    """A field of a resolved config (`Case.resolve` filled it); ValueError naming it where it is
    still unset (a case function handed an unresolved config)."""
    if value is None:
        raise ValueError(f"config.{field} is unset: resolve the config first (Case.resolve)")
    return value


def as_gpt(ref: nn.Module) -> GPT:
    """The reference a GPT case's `shard` is handed (a `Case.shard` takes any Module), as the GPT."""
    if not isinstance(ref, GPT):
        raise TypeError(f"expected the reference GPT, got {type(ref).__name__}")
    return ref


def attention_of(block: nn.Module) -> Attention:
    """A reference GPT block's attention, as its type (nn.ModuleList hands out plain Modules)."""
    attn = block.attn
    if not isinstance(attn, Attention):
        raise TypeError(f"expected the reference GPT's Attention in {type(block).__name__}, got {type(attn).__name__}")
    return attn


def gpt_config(config: CheckConfig) -> GPTConfig:
    return GPTConfig(vocab=known(config.vocab, "vocab"), max_seq_len=max(64, known(config.seq_len, "seq_len")),
                     hidden=known(config.hidden, "hidden"), num_heads=known(config.num_heads, "num_heads"),
                     ffn=known(config.ffn, "ffn"), num_layers=known(config.num_layers, "num_layers"),
                     norm=known(config.norm, "norm"), num_kv_heads=config.num_kv_heads,
                     causal=True if config.causal is None else config.causal)


def build_reference_gpt(config: CheckConfig) -> nn.Module:
    return build_gpt(gpt_config(config), seed=config.seed)


def with_defaults(config: CheckConfig, defaults: Mapping[str, Any]) -> CheckConfig:
    """`config` with its None fields taken from a case's `defaults` (explicit shards fixing the
    sequence length first, as `Case.resolve` does): for the case's own functions, which may be
    handed a config that was not resolved (a test's, a mutant's)."""
    if config.seq_len is None and config.seq_shards is not None:
        config = config.replace(seq_len=sum(config.seq_shards))
    filled = {k: v for k, v in defaults.items() if getattr(config, k, None) is None}
    return config.replace(**filled) if filled else config


def gpt_memory_floor(config: CheckConfig) -> int:
    """A lower bound of a GPT reference process's peak bytes (`Case.memory_floor`): the float64
    reference and its perturbed twin, each with a grad per param (32 bytes a param), and the
    attention probabilities every layer keeps for backward, (B, heads, S, S) in float64: only
    the terms no implementation avoids, so it never refuses a config that fits."""
    h, layers = known(config.hidden, "hidden"), known(config.num_layers, "num_layers")
    ffn = config.ffn or 4 * h
    num_params = layers * (4 * h * h + 2 * h * ffn) + known(config.vocab, "vocab") * h
    seq_len, heads = known(config.seq_len, "seq_len"), known(config.num_heads, "num_heads")
    probs = layers * config.dp * known(config.batch, "batch") * heads * seq_len ** 2
    return 32 * num_params + 8 * probs


def gpt_batch(config: CheckConfig, step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens [dp*batch, seq_len] and their next-token targets.

    No token equals its neighbour (each is the previous plus a random 1..vocab-1, mod vocab), so
    every possible shard boundary separates two different tokens and two different targets: a
    bug at a boundary (a label shifted across it, a token dropped or repeated there) always
    changes the numbers, whatever split the config draws. The first `prompt_len` targets of each
    sequence are IGNORE_INDEX (a fine-tuning prompt)."""
    rows, length = config.dp * known(config.batch, "batch"), known(config.seq_len, "seq_len") + 1
    vocab = known(config.vocab, "vocab")
    first = torch.randint(0, vocab, (rows, 1), generator=gen)
    if vocab < 2:
        tokens = first.expand(rows, length)
    else:
        steps = torch.randint(1, vocab, (rows, length - 1), generator=gen)
        tokens = torch.cat([first, first + steps.cumsum(1)], dim=1) % vocab
    targets = tokens[:, 1:].clone()
    targets[:, : config.prompt_len or 0] = IGNORE_INDEX  # the prompt carries no loss
    return tokens[:, :-1], targets


@functools.lru_cache(maxsize=8)
def _chain(vocab: int, seed: int, concentration: float) -> MarkovChain:
    # every step of a run asks for the same chain: draw it (and its alias tables) once
    return MarkovChain.from_seed(vocab=vocab, seed=seed, concentration=concentration)


def with_positions(tokens: torch.Tensor, targets: torch.Tensor) -> Batch:
    """Tokens (B, S) and their global positions arange(S) per sequence, as named inputs: a
    sequence-sharded model's piece then embeds its own tokens' global positions."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()  # (B, S) int64
    return Batch(inputs={"tokens": tokens, "positions": positions}, target=targets)


def markov_training(concentration: float = 0.1, *, positions: bool = False) -> Training:
    """Train on a fixed random Markov chain over the model's vocabulary (config.vocab), drawn
    from the data seed; its entropy rate is the exact floor of the next-token loss
    (sp_harness.step.data). Lower `concentration`: more predictable rows, a lower floor.
    `positions`: batches carry the positions input too (`with_positions`)."""

    def batches(config: CheckConfig, step: int, data_seed: int) -> Batch | tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
        chain = _chain(known(config.vocab, "vocab"), data_seed, concentration)
        made = chain.sample(config.dp * known(config.batch, "batch"), known(config.seq_len, "seq_len"), gen)
        return with_positions(*made) if positions else made

    def loss_floor(config: CheckConfig, data_seed: int) -> float:
        return _chain(known(config.vocab, "vocab"), data_seed, concentration).entropy_rate

    return Training(batches=batches, loss_floor=loss_floor, floor_label="entropy rate of the Markov chain",
                    seq_len=32, batch=8)


MARKOV_TRAINING = markov_training()
"""The GPT cases' convergence data: vocab from the config, concentration 0.1."""
MARKOV_TRAINING_WITH_POSITIONS = markov_training(positions=True)
"""The same chain for models that take their tokens' positions as an input."""


def gpt_tokens(target: torch.Tensor) -> int:
    """Targets that carry loss: a prompt's IGNORE_INDEX labels do not count."""
    return int((target != IGNORE_INDEX).sum())


def mse_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target.to(output.dtype), reduction="sum")


def gpt_fields(defaults: Mapping[str, Any], *, positions: bool) -> dict[str, Any]:
    """The `Case` fields every built-in GPT case shares: the float64 reference GPT, `gpt_batch`'s
    tokens (with their positions as a second input where `positions`: models that embed a
    sequence shard's own global positions), the token-loss sum over targets that carry loss, the
    memory floor, [b, s] inputs and the Markov-chain convergence data. The reference and the batch
    fill their config from `defaults` first (`with_defaults`)."""

    def build_reference(config: CheckConfig) -> nn.Module:
        return build_reference_gpt(with_defaults(config, defaults))

    def make_batch(config: CheckConfig, step: int, gen: torch.Generator) -> Batch | tuple[torch.Tensor, torch.Tensor]:
        made = gpt_batch(with_defaults(config, defaults), step, gen)  # int64 (B, S) tokens, targets
        return with_positions(*made) if positions else made

    return dict(build_reference=build_reference, make_batch=make_batch, loss_sum=token_loss_sum, tokens=gpt_tokens,
                memory_floor=gpt_memory_floor, defaults=defaults, input_layout=GPT_INPUT,
                training=MARKOV_TRAINING_WITH_POSITIONS if positions else MARKOV_TRAINING)


def require_heads(config: CheckConfig) -> None:
    """ValueError unless num_heads divides hidden and num_kv_heads (None: num_heads) divides
    num_heads: a GPT config that makes no sense, whatever the case."""
    a, hidden = known(config.num_heads, "num_heads"), known(config.hidden, "hidden")
    a_kv = config.num_kv_heads or a
    if hidden % a:
        raise ValueError(f"num_heads({a}) does not divide hidden({hidden})")
    if a % a_kv:
        raise ValueError(f"num_kv_heads({a_kv}) does not divide num_heads({a})")


def require_bsh(config: CheckConfig, what: str) -> None:
    """Cases whose activations are [b, s, h] only: layout 'sbh' is UNSUPPORTED."""
    if config.layout not in (None, "bsh"):
        raise Unsupported(f"{what} keeps activations [b, s, h]: layout {config.layout!r} asked")


def all_reduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divide_by: int = 1) -> None:
    """One flat all-reduce for a list of grads (Megatron / NeMo coalesce these), in place."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def sum_replicated_grads(module: nn.Module, ctx: RankContext, over: Sequence[dist.ProcessGroup] | None = None) -> None:
    """After backward, for a model whose every param is a replicated copy and whose every rank's
    loss covers its own tokens: each grad is SUMMED over the groups `over` (None: the TP group,
    which is the sequence-parallel group; a hybrid's sub-groups one after another), then averaged
    over DP. A param this rank's tokens never reached gets a zero grad first: its share is zero,
    and the coalesced all-reduce needs the same list of grads on every rank."""
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    for group in (ctx.tp_group,) if over is None else over:
        if dist.get_world_size(group) > 1:
            all_reduce_coalesced(grads, group)
    if ctx.dp > 1:
        all_reduce_coalesced(grads, ctx.dp_group, divide_by=ctx.dp)


def require_whole_cp_group(config: CheckConfig, what: str) -> None:
    """Context parallelism of the reference GPT over the whole CP group: layout 'sbh' (the GPT is
    [b, s, h]) and a ring_degree other than 1 or cp (no hybrid) are UNSUPPORTED."""
    if config.layout == "sbh":
        raise Unsupported(f"{what} runs the reference GPT in [b, s, h]: layout 'sbh' asked")
    if config.ring_degree not in (None, 1, config.tp):
        raise Unsupported(f"{what} runs over the whole CP group: ring_degree({config.ring_degree}) must be 1 or "
                          f"cp = world_size({config.world_size}) / dp({config.dp}) = {config.tp}")


def require_plain_attention(config: CheckConfig, what: str) -> None:
    """Cases that shard heads with full multi-head, causal attention only."""
    if config.num_kv_heads not in (None, config.num_heads):
        raise Unsupported(f"{what} shards full multi-head attention: num_kv_heads({config.num_kv_heads}) "
                          f"must equal num_heads({config.num_heads})")
    if config.causal is False:
        raise Unsupported(f"{what} implements causal attention only (causal=False asked)")


def require_chunk_split(config: CheckConfig, what: str) -> None:
    """DTensor's Shard(dim) can only split by torch.chunk: reject other explicit splits."""
    if config.seq_shards is None:
        return
    seq_len = known(config.seq_len, "seq_len")
    if tuple(config.seq_shards) != chunk_sizes(seq_len, config.tp):
        raise Unsupported(
            f"{what} shards the sequence with DTensor Shard(dim), which splits by torch.chunk: "
            f"seq_shards {list(config.seq_shards)} differ from chunk_sizes({seq_len}, {config.tp}) = "
            f"{list(chunk_sizes(seq_len, config.tp))}"
        )


__all__ = ["gpt_memory_floor", "with_positions", "MARKOV_TRAINING_WITH_POSITIONS", "require_plain_attention", "GPT_DEFAULTS",
           "GPT_INPUT", "MARKOV_TRAINING", "markov_training", "gpt_config", "build_reference_gpt", "gpt_batch", "gpt_tokens",
           "mse_sum", "require_chunk_split", "token_loss_sum", "with_defaults", "gpt_fields", "require_heads", "require_bsh", "require_whole_cp_group",
           "all_reduce_coalesced", "LocalLoss", "known", "attention_of", "as_gpt", "sum_replicated_grads"]
