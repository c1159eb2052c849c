"""usp-gpt: the Ulysses x ring hybrid ("USP", yunchang / TransformerEngine's a2a+p2p)."""

from sp_harness.cases.usp import cases  # noqa: F401
