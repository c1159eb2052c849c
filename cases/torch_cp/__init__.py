"""torch-cp-gpt: PyTorch's own `context_parallel` on the reference GPT (torch 2.13, CPU); torch_cp/cases.py."""
