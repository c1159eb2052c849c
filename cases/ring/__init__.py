"""ring-gpt: context parallelism by ring attention (issue 11)."""

from sp_harness.cases.ring import cases  # noqa: F401
