"""Stage: step. Synthetic token streams whose ideal loss is known exactly.

A fixed random first-order Markov chain over `vocab` tokens: row i of the transition matrix is
P(next = j | current = i), drawn once from a symmetric Dirichlet(concentration) from a seed.
A small concentration makes rows peaked, so the entropy rate is well below log(vocab) and a
model that learns the bigram statistics has visible headroom to descend into.

The loss floor. `sample` draws seq_len + 1 tokens per row, the first from the stationary
distribution pi, and returns inputs = tokens[:, :-1] and targets = tokens[:, 1:]. Every target
therefore has its previous token among the inputs, and every input position is marginally
distributed as pi (the chain starts stationary and stays stationary). The expected per-target
cross-entropy of any predictor q(. | whole prefix) is then at least

    H = -sum_i pi_i sum_j P_ij log P_ij      (nats; the chain's entropy rate)

with equality for q = P[previous token]: by the Markov property the prefix carries no more
information about the next token than the previous token does. So `entropy_rate` is exactly the
floor of the mean next-token cross-entropy of a causal model on these batches, and a trained
model's loss minus `entropy_rate` is its distance to optimal. (Had the first token been drawn
uniformly, or counted as a target with no context, the floor would differ; neither happens.)

Everything is deterministic in the seeds: the chain in `seed`, the batches in the
torch.Generator passed to `sample`; the global RNG state is left as it was.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

MAX_VOCAB = 4096
"""Largest vocabulary: the transition matrix is vocab^2 float64 (128 MiB at 4096)."""


@dataclass(kw_only=True, frozen=True, eq=False)
class MarkovChain:
    """A first-order Markov chain over tokens 0..vocab-1 with its exact statistics (float64)."""

    vocab: int
    """Number of tokens (states)."""
    seed: int
    """Seed the transition matrix was drawn from."""
    concentration: float
    """Symmetric Dirichlet parameter of each row; < 1 gives peaked rows and a low entropy rate."""
    transition: torch.Tensor
    """(vocab, vocab) float64, row-stochastic, every entry > 0: P[i, j] = P(next=j | cur=i)."""
    stationary: torch.Tensor
    """(vocab,) float64, the unique pi with pi @ transition = pi, sum 1."""
    entropy_rate: float
    """-sum_i pi_i sum_j P_ij log P_ij in nats: the loss floor of next-token prediction."""

    @classmethod
    def from_seed(cls, *, vocab: int, seed: int, concentration: float = 0.1) -> "MarkovChain":
        """Draw the chain's rows from Dirichlet(concentration) seeded by `seed`."""
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {vocab}")
        if vocab > MAX_VOCAB:
            raise ValueError(
                f"vocab must be <= {MAX_VOCAB} (the chain stores a vocab x vocab matrix), got {vocab}"
            )
        if not (concentration > 0 and math.isfinite(concentration)):
            raise ValueError(f"concentration must be finite and > 0, got {concentration}")
        with torch.random.fork_rng(devices=[]):
            # Dirichlet has no generator argument; a forked, seeded global RNG keeps it
            # reproducible without disturbing the caller's RNG stream
            torch.manual_seed(seed)
            alpha = torch.full((vocab, vocab), float(concentration), dtype=torch.float64)
            rows = torch.distributions.Dirichlet(alpha).sample()
        # small concentrations can underflow entries to 0.0; strictly positive entries keep the
        # chain irreducible and aperiodic, so pi is unique and every log P_ij is finite
        rows = rows.clamp_min(torch.finfo(torch.float64).tiny)
        transition = rows / rows.sum(dim=1, keepdim=True)
        stationary = _stationary(transition)
        plogp = torch.where(transition > 0, transition * transition.log(), 0.0)
        entropy_rate = float(-(stationary * plogp.sum(dim=1)).sum())
        return cls(
            vocab=vocab,
            seed=seed,
            concentration=float(concentration),
            transition=transition,
            stationary=stationary,
            entropy_rate=entropy_rate,
        )

    @property
    def uniform_entropy(self) -> float:
        """log(vocab): the loss of a model that predicts uniformly (roughly the loss at init)."""
        return math.log(self.vocab)

    @property
    def unigram_entropy(self) -> float:
        """H(pi): the floor for a model that ignores context and learns token frequencies."""
        pi = self.stationary
        return float(-(torch.where(pi > 0, pi * pi.log(), 0.0)).sum())

    def sample(
        self, batch: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (batch, seq_len) int64 on CPU, targets = inputs shifted by one.

        Uses exactly one torch.rand draw of (batch, seq_len + 1) from `generator`, so the same
        generator state gives the same batch on every machine and rank. (The alias method
        spends log2(vocab) of u's 53 bits on the column, so probabilities are resolved to
        ~2^-(53 - log2 vocab): a bias below 1e-13 for any vocab this class can hold.)
        """
        if batch < 1 or seq_len < 1:
            raise ValueError(f"batch and seq_len must be >= 1, got batch={batch} seq_len={seq_len}")
        u = torch.rand((batch, seq_len + 1), generator=generator, dtype=torch.float64)
        prob, alias = self._alias_tables
        v = self.vocab
        # one uniform per token: its top bits pick an alias-table column, the rest decide
        # between the column and its alias (Walker/Vose: O(1) per token, exact up to rounding)
        scaled = u * v
        col = scaled.floor().to(torch.int64).clamp_max(v - 1)
        frac = scaled - col
        tokens = torch.empty((batch, seq_len + 1), dtype=torch.int64)
        prev = torch.full((batch,), v, dtype=torch.int64)  # row v holds the stationary pi
        # the loop is sequential in t but every op touches O(batch) elements, below torch's
        # threading grain size, so it runs as fast on a busy machine as on an idle one
        for t in range(seq_len + 1):
            idx = prev * v + col[:, t]
            prev = torch.where(frac[:, t] < prob[idx], col[:, t], alias[idx])
            tokens[:, t] = prev
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    @functools.cached_property
    def _alias_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Vose alias tables, flattened (vocab + 1) x vocab: rows 0..V-1 for P, row V for pi."""
        probs, aliases = [], []
        for row in [*self.transition.tolist(), self.stationary.tolist()]:
            p, a = _alias_row(row)
            probs += p
            aliases += a
        return torch.tensor(probs, dtype=torch.float64), torch.tensor(aliases, dtype=torch.int64)

    def cross_entropy(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean -log P[input, target] over all positions: the ideal model's loss on this batch."""
        if inputs.shape != targets.shape:
            raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ")
        logp = self.transition.log()[inputs.reshape(-1), targets.reshape(-1)]
        return float(-logp.mean())

    def describe(self) -> dict[str, float | int]:
        """Plain-JSON summary for run metadata (the report draws `entropy_rate` as the floor)."""
        return {
            "vocab": self.vocab,
            "seed": self.seed,
            "concentration": self.concentration,
            "entropy_rate": self.entropy_rate,
            "unigram_entropy": self.unigram_entropy,
            "uniform_entropy": self.uniform_entropy,
        }


def _alias_row(p: list[float]) -> tuple[list[float], list[int]]:
    """Vose's alias method for one distribution: column k is returned with probability
    prob[k], else alias[k]; a uniform column choice then reproduces p."""
    n = len(p)
    total = math.fsum(p)
    scaled = [x * n / total for x in p]
    small = [i for i, x in enumerate(scaled) if x < 1.0]
    large = [i for i, x in enumerate(scaled) if x >= 1.0]
    prob, alias = [1.0] * n, list(range(n))
    while small and large:
        s, big = small.pop(), large.pop()
        prob[s], alias[s] = scaled[s], big
        scaled[big] = (scaled[big] + scaled[s]) - 1.0
        (small if scaled[big] < 1.0 else large).append(big)
    # what is left is 1.0 up to rounding: always take the column itself
    return prob, alias


def _stationary(transition: torch.Tensor) -> torch.Tensor:
    """pi with pi P = pi and sum(pi) = 1, by solving (P^T - I) pi = 0 with one row replaced."""
    v = transition.shape[0]
    a = transition.T - torch.eye(v, dtype=transition.dtype)
    # the equations are rank v-1; swapping one for the normalisation makes the system regular
    a[-1, :] = 1.0
    b = torch.zeros(v, dtype=transition.dtype)
    b[-1] = 1.0
    pi = torch.linalg.solve(a, b).clamp_min(0.0)
    return pi / pi.sum()
