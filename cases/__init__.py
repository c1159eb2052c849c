"""Systems under test. Importing this package registers every built-in case."""

from sp_harness.cases import dtensor_plans, megatron, mutants, ring, torch_cp, ulysses, usp  # noqa: F401
