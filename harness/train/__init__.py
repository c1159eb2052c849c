"""Stage: train (above step, capture, compare; below record). Lockstep convergence training:
`spec` (what one run is, the LR schedule, the batch stream a case declares), `rank` (the job
functions each rank runs, keeping the models between jobs) and `driver` (runs those jobs on a
runner in chunks and collects the per-step results as plain dataclasses)."""
