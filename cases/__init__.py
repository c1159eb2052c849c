"""Systems under test. Importing this package registers every built-in case."""

from cases import megatron, mutants  # noqa: F401
