"""torch-cp-gpt: PyTorch's own `context_parallel` on the reference GPT (torch 2.13, CPU)."""

from sp_harness.cases.torch_cp import cases  # noqa: F401
