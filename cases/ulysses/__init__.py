"""DeepSpeed-Ulysses all-to-all sequence parallelism: the `ulysses-gpt` case (ulysses/cases.py)."""
