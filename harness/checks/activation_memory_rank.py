"""Stage: checks. The activation-memory check's rank job (sp_harness.checks.activation_memory
drives it), its in-process twin and the config both measure.

`activation_rank(config)` is the job the pool runs: the case's sharded model built as the engine
builds it, one forward + backward of the engine's step on this rank's piece of a batch, and what
`blocks[0]` saved for backward (sp_harness.capture.saved_activations). `measure_reference_layer`
is the no-parallelism row: the reference's first layer, in-process.
"""

from __future__ import annotations

import torch

from sp_harness.capture.saved_activations import LayerMemory, SavedTensorMeter, find_layer
from sp_harness.config.check_config import CheckConfig


def memory_config(config: CheckConfig) -> CheckConfig:
    """The config the memory check measures: the case's defaults, ffn = 4h unless given, LayerNorm."""
    from sp_harness.config.registry import get_case

    cfg = get_case(config.case).resolve(config)
    if config.ffn is None:
        assert cfg.hidden is not None, f"case {cfg.case} resolves no hidden size: no layer to measure"
        cfg = cfg.replace(ffn=4 * cfg.hidden)
    return cfg


def measure_reference_layer(config: CheckConfig) -> LayerMemory:
    """No parallelism, in-process: the first layer of the case's reference fed [b, s, h] in the run
    dtype."""
    from sp_harness.config.registry import get_case
    from sp_harness.step.build import cast_floating, new_reference

    cfg = memory_config(config)
    block = cast_floating(find_layer(new_reference(get_case(cfg.case), cfg, None)), cfg.torch_dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    assert cfg.batch is not None and cfg.seq_len is not None and cfg.hidden is not None, "memory_config resolves the shape"
    x = torch.randn(cfg.dp * cfg.batch, cfg.seq_len, cfg.hidden, generator=gen, dtype=torch.float64)
    x = x.to(cfg.torch_dtype).requires_grad_(True)
    with SavedTensorMeter(block) as meter:
        y = block(x)
    y.float().sum().backward()
    return meter.result


def activation_rank(config: CheckConfig) -> LayerMemory:
    """Rank job: build the case's sharded model as the engine does, run one forward + backward
    (the engine's step, sp_harness.step.loop) on this rank's piece of a batch, and return what
    `blocks[0]` saved (the loss after the layer saves nothing inside it)."""
    from sp_harness.config.case import as_batch
    from sp_harness.step.build import build
    from sp_harness.step.inputs import batch_generator
    from sp_harness.step.loop import ShardedLoop

    built = build(config)
    meter = SavedTensorMeter(find_layer(built.sharded.module), params_of=built.sharded.module)

    def phase(name: str) -> None:
        # the forward only: a backward that recomputes the layer would be counted twice
        if name == "forward":
            meter.__enter__()
        else:
            meter.__exit__()

    loop = ShardedLoop(built, phase=phase)
    batch = as_batch(built.case.make_batch(config, 0, batch_generator(config.seed)))
    loop.forward_backward(loop.local_batch(batch), batch.target)
    meter.__exit__()
    meter.result.rank = built.ctx.rank
    return meter.result
