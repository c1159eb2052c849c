"""Stage: suites. What the training-step check costs against a side-by-side check of the same
config and K (bench row k): the side-by-side check's batch is K times the training step's, so
both judge the same tokens per step; the ratio is the price of the case's own step, its
micro-batch loop and the stages judged between its parts (the norm's composition at step 0).

  train_s      median warm `train-step` check: ws 4, dp 2, K 3, SGD, clipping active, float64
  side_s       median warm `side-by-side` check of the same config, batch x K, no K
"""

from __future__ import annotations

import statistics
import time

from sp_harness.checks import get_check, run_check
from sp_harness.config.check_config import CheckConfig

TARGET_RATIO = 2.0
"""Issue 50: a training-step check costs at most 2x a side-by-side check of the same config and K."""


def train_row(runner, *, case: str = "megatron-gpt-sp", reps: int = 3, micro_batches: int = 3) -> dict:
    train = CheckConfig(case=case, world_size=4, dp=2, train_step=True, micro_batches=micro_batches,
                        optimizer="sgd", clip_grad_norm=0.01)
    side = CheckConfig(case=case, world_size=4, dp=2, optimizer="sgd", batch=2 * micro_batches)

    def median(name: str, config: CheckConfig) -> tuple[float, str]:
        run_check(get_check(name), config, runner)  # warm: pool, setup, first-use imports
        times, status = [], ""
        for _ in range(reps):
            t0 = time.perf_counter()
            status = run_check(get_check(name), config, runner).status
            times.append(time.perf_counter() - t0)
        return statistics.median(times), status

    train_s, train_status = median("train-step", train)
    side_s, side_status = median("side-by-side", side)
    return {"case": case, "micro_batches": micro_batches, "train_s": train_s, "side_s": side_s,
            "ratio": train_s / side_s, "train": train_status, "side": side_status}


def format_train(row: dict) -> str:
    return (f"(k) training-step check vs side-by-side, {row['case']} ws 4 dp 2, K {row['micro_batches']} "
            f"(side-by-side batch x K): {row['train_s']:.2f}s vs {row['side_s']:.2f}s = {row['ratio']:.2f}x "
            f"({row['train']} / {row['side']})")
