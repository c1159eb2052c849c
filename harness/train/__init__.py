"""Stage: train. Lockstep convergence training:
`spec` (what one run is, the LR schedule, the batch stream a case declares), `rank` (the job
functions each rank runs, keeping the models between jobs) and `driver` (runs those jobs on a
runner in chunks and collects the per-step results as plain dataclasses); `lockstep_runs`
(converge's engine: the case, its baseline and the reference copy trained and gated)."""
