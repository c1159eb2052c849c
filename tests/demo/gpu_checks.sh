#!/usr/bin/env bash
# yunchang's ring on FlashAttention-2 (torch's CUDA flash kernels), judged by the bfloat16 model:
# run on a machine with one CUDA GPU, from the repository root, with the yunchang wheel in .whl/
# (`pip download --no-deps yunchang==0.6.4 -d .whl`). The ranks are gloo processes on the CPU
# (one GPU cannot host two nccl ranks); each ring block is handed to the GPU and back.
#
#     bash tests/demo/gpu_checks.sh OUTDIR SECONDS [STREAMS]
#
# OUTDIR gets log.txt (environment, the GPU kernel tests, two checks) and campaign.jsonl (one
# record per draw of tests/demo/false_alarms.py, STREAMS streams for SECONDS each).
set -u
out=$1; seconds=$2; streams=${3:-4}
export PYTHONUNBUFFERED=1
log=$out/log.txt
{
  echo "== environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -V; nproc
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "== install"
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  echo "== tests/test_yunchang.py (its GPU kernel tests among them)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_yunchang.py 2>&1 | tail -15
} > "$log" 2>&1
seed0=$((70000 + RANDOM % 1000))
for i in $(seq 1 "$streams"); do
  timeout "$seconds" python3 tests/demo/false_alarms.py yc-usp-torch-flash 400 --dtype bfloat16 --training-every 2 \
    --expected PASS --seed $((seed0 + i)) --out "$out/stream$i.jsonl" > "$out/stream$i.txt" 2>&1 &
done
{
  echo "== checks (beside the campaign)"
  for ws in 2 4; do
    timeout 240 sp-harness check --case yc-usp-torch-flash --world-size $ws --dtype bfloat16 --adversary reorder 2>&1 | head -12
  done
} >> "$log" 2>&1
wait
{
  echo "== campaign streams (seeds from $((seed0 + 1)))"
  for i in $(seq 1 "$streams"); do tail -3 "$out/stream$i.txt"; done
} >> "$log" 2>&1
cat "$out"/stream*.jsonl > "$out/campaign.jsonl" 2>/dev/null
rm -f "$out"/stream*
