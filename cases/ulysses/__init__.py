"""DeepSpeed-Ulysses all-to-all sequence parallelism: the `ulysses-gpt` case."""

from sp_harness.cases.ulysses import cases  # noqa: F401
