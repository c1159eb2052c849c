"""The mutant catalogue: realistic broken SP implementations the default suite must kill."""

from sp_harness.cases.mutants import (
    clip_mutants,  # noqa: F401
    dtensor_mutants,  # noqa: F401
    megatron_collective_mutants,  # noqa: F401
    megatron_mutants,  # noqa: F401
    memory_mutants,  # noqa: F401
    ring_mutants,  # noqa: F401
    scaled_mutants,  # noqa: F401  (sensitivity probes, tagged 'scaled': not in the battery)
    ulysses_mutants,  # noqa: F401
    usp_mutants,  # noqa: F401
)
