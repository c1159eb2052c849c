"""The Markov-chain data: its entropy rate really is the loss floor, and sampling is reproducible."""

import math

import pytest
import torch

from sp_harness.step.data import MarkovChain


@pytest.fixture(scope="module")
def chain() -> MarkovChain:
    return MarkovChain.from_seed(vocab=64, seed=0, concentration=0.1)


def test_chain_is_a_stationary_markov_chain(chain):
    p = chain.transition
    assert p.shape == (64, 64) and p.dtype == torch.float64
    assert (p > 0).all()
    torch.testing.assert_close(p.sum(1), torch.ones(64, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(chain.stationary @ p, chain.stationary, rtol=0, atol=1e-12)
    assert abs(float(chain.stationary.sum()) - 1.0) < 1e-12


def test_entropy_rate_is_well_below_uniform(chain):
    # peaked rows leave a model real headroom between init (~log V) and the floor
    assert 0 < chain.entropy_rate < chain.unigram_entropy < chain.uniform_entropy
    assert chain.entropy_rate < 0.7 * chain.uniform_entropy


def test_empirical_cross_entropy_of_true_model_matches_entropy_rate(chain):
    gen = torch.Generator().manual_seed(1)
    inputs, targets = chain.sample(1024, 1024, gen)  # 1M targets
    # standard error of the mean of -log p is ~1.1/sqrt(1M) = 1.1e-3 (chain correlation is
    # weak); 4e-3 is ~3.6 standard errors
    assert abs(chain.cross_entropy(inputs, targets) - chain.entropy_rate) < 4e-3


def test_alias_tables_reproduce_the_chain_exactly(chain):
    # the sampler's distribution, rebuilt from its tables, is P (and pi for the first token)
    prob, alias = chain._alias_tables
    v = chain.vocab
    prob, alias = prob.view(v + 1, v), alias.view(v + 1, v)
    dist = torch.zeros(v + 1, v, dtype=torch.float64)
    dist.scatter_add_(1, torch.arange(v).expand(v + 1, v), prob / v)
    dist.scatter_add_(1, alias, (1 - prob) / v)
    torch.testing.assert_close(dist[:v], chain.transition, rtol=0, atol=1e-15)
    torch.testing.assert_close(dist[v], chain.stationary, rtol=0, atol=1e-15)


def test_inputs_are_stationary_and_targets_are_shifted_inputs(chain):
    gen = torch.Generator().manual_seed(2)
    inputs, targets = chain.sample(256, 256, gen)
    assert inputs.shape == targets.shape == (256, 256)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.min()) >= 0 and int(targets.max()) < 64
    freq = torch.bincount(inputs.reshape(-1), minlength=64).double() / inputs.numel()
    assert float((freq - chain.stationary).abs().max()) < 5e-3


def test_sampling_is_deterministic_in_the_generator_and_leaves_global_rng_alone(chain):
    state = torch.random.get_rng_state()
    a = chain.sample(4, 16, torch.Generator().manual_seed(7))
    b = chain.sample(4, 16, torch.Generator().manual_seed(7))
    c = chain.sample(4, 16, torch.Generator().manual_seed(8))
    again = MarkovChain.from_seed(vocab=64, seed=0, concentration=0.1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(again.transition, chain.transition)
    assert again.entropy_rate == chain.entropy_rate
    assert not torch.equal(MarkovChain.from_seed(vocab=64, seed=1).transition, chain.transition)


def test_describe_is_plain_json(chain):
    import json

    d = json.loads(json.dumps(chain.describe()))
    assert d["entropy_rate"] == chain.entropy_rate
    assert d["uniform_entropy"] == pytest.approx(math.log(64))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab": 1, "seed": 0}, "vocab must be >= 2, got 1"),
        ({"vocab": 8, "seed": 0, "concentration": 0.0}, "concentration must be finite and > 0, got 0.0"),
        ({"vocab": 5000, "seed": 0}, "vocab must be <= 4096 .*, got 5000"),
    ],
)
def test_bad_arguments_name_the_numbers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MarkovChain.from_seed(**kwargs)


def test_bad_sample_shape(chain):
    with pytest.raises(ValueError, match="batch=0 seq_len=4"):
        chain.sample(0, 4, torch.Generator())
