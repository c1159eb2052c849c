"""Shared pieces of the built-in cases: GPT config from a CheckConfig, batches, losses."""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from sp_harness.config.case import Batch, Training, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.shards import chunk_sizes
from sp_harness.reference.gpt import GPTConfig, build_gpt, token_loss_sum
from sp_harness.step.data import MarkovChain

IGNORE_INDEX = -100
"""A target that carries no loss (F.cross_entropy's default ignore_index, as in HF and Megatron)."""
GPT_DEFAULTS = dict(seq_len=12, hidden=32, ffn=64, num_heads=4, num_layers=2, vocab=64)


def gpt_config(config: CheckConfig) -> GPTConfig:
    return GPTConfig(vocab=config.vocab, max_seq_len=max(64, config.seq_len), hidden=config.hidden,
                     num_heads=config.num_heads, ffn=config.ffn, num_layers=config.num_layers, norm=config.norm,
                     num_kv_heads=config.num_kv_heads, causal=True if config.causal is None else config.causal)


def build_reference_gpt(config: CheckConfig):
    return build_gpt(gpt_config(config), seed=config.seed)


def gpt_memory_floor(config: CheckConfig) -> int:
    """A lower bound of a GPT reference process's peak bytes (`Case.memory_floor`): the float64
    reference and its perturbed twin, each with a grad per param (32 bytes a param), and the
    attention probabilities every layer keeps for backward, (B, heads, S, S) in float64: only
    the terms no implementation avoids, so it never refuses a config that fits."""
    h, ffn, layers = config.hidden, config.ffn or 4 * config.hidden, config.num_layers
    num_params = layers * (4 * h * h + 2 * h * ffn) + config.vocab * h
    probs = layers * config.dp * config.batch * config.num_heads * config.seq_len ** 2
    return 32 * num_params + 8 * probs


def gpt_batch(config: CheckConfig, step: int, gen: torch.Generator):
    """Random tokens [dp*batch, seq_len] and their next-token targets.

    No token equals its neighbour (each is the previous plus a random 1..vocab-1, mod vocab), so
    every possible shard boundary separates two different tokens and two different targets: a
    bug at a boundary (a label shifted across it, a token dropped or repeated there) always
    changes the numbers, whatever split the config draws. The first `prompt_len` targets of each
    sequence are IGNORE_INDEX (a fine-tuning prompt)."""
    rows, length = config.dp * config.batch, config.seq_len + 1
    first = torch.randint(0, config.vocab, (rows, 1), generator=gen)
    if config.vocab < 2:
        tokens = first.expand(rows, length)
    else:
        steps = torch.randint(1, config.vocab, (rows, length - 1), generator=gen)
        tokens = torch.cat([first, first + steps.cumsum(1)], dim=1) % config.vocab
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

    def batches(config: CheckConfig, step: int, data_seed: int):
        gen = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
        made = _chain(config.vocab, data_seed, concentration).sample(config.dp * config.batch, config.seq_len, gen)
        return with_positions(*made) if positions else made

    def loss_floor(config: CheckConfig, data_seed: int) -> float:
        return _chain(config.vocab, data_seed, concentration).entropy_rate

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


def require_plain_attention(config: CheckConfig, what: str) -> None:
    """Cases that shard heads with full multi-head, causal attention only."""
    if config.num_kv_heads not in (None, config.num_heads):
        raise Unsupported(f"{what} shards full multi-head attention: num_kv_heads({config.num_kv_heads}) "
                          f"must equal num_heads({config.num_heads})")
    if config.causal is False:
        raise Unsupported(f"{what} implements causal attention only (causal=False asked)")


def require_chunk_split(config: CheckConfig, what: str) -> None:
    """DTensor's Shard(dim) can only split by torch.chunk: reject other explicit splits."""
    if config.seq_shards is not None and tuple(config.seq_shards) != chunk_sizes(config.seq_len, config.tp):
        raise Unsupported(
            f"{what} shards the sequence with DTensor Shard(dim), which splits by torch.chunk: "
            f"seq_shards {list(config.seq_shards)} differ from chunk_sizes({config.seq_len}, {config.tp}) = "
            f"{list(chunk_sizes(config.seq_len, config.tp))}"
        )


__all__ = ["gpt_memory_floor", "with_positions", "MARKOV_TRAINING_WITH_POSITIONS", "require_plain_attention", "GPT_DEFAULTS", "MARKOV_TRAINING", "markov_training", "gpt_config", "build_reference_gpt", "gpt_batch", "gpt_tokens", "mse_sum",
           "require_chunk_split", "token_loss_sum"]
