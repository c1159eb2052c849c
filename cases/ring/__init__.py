"""ring-gpt: context parallelism by ring attention (issue 11). Registered by ring/cases.py."""
