#!/usr/bin/env bash
# The false-alarm campaign on a many-core machine (a lent GPU machine's CPUs): the four SP cases
# x three kernel families (native, avx2, default), one stream each, every rank on the CPU (CUDA
# hidden, so the verdicts are the CPU kernels' as in CI), OMP 1. From the repository root:
#
#     bash tests/demo/device_campaign.sh OUTDIR SECONDS DTYPE SEED0
#
# OUTDIR gets log.txt (environment, each stream's last lines) and <family>-<dtype>.jsonl (one
# record per draw of tests/demo/false_alarms.py, named as tests/demo/campaign_table.py reads a
# kernel family). Stream k draws with hypothesis seed SEED0 + k.
# Memory: 12 streams of training-size float32 draws outgrew 128 GiB once (14 of 418 draws lost to
# SIGKILL in the thirteenth session's first run); a killed rank is recorded as FAIL with its
# signal, so count those apart from the verdicts (they carry no check ratios).
set -u
out=$1; seconds=$2; dtype=$3; seed0=$4
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
log=$out/log.txt
{
  echo "== environment"
  python3 -V; python3 -c "import os; print(os.cpu_count(), 'cores')"; lscpu | grep -m1 "Model name"
  python3 -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
} > "$log" 2>&1
k=0
for fam in native avx2 default; do
  for case in megatron-gpt-sp ring-gpt ulysses-gpt usp-gpt; do
    k=$((k + 1))
    cap=""; [ "$fam" != native ] && cap="ATEN_CPU_CAPABILITY=$fam"
    env $cap timeout "$seconds" python3 tests/demo/false_alarms.py "$case" 400 --dtype "$dtype" --training-every 2 \
      --realistic-every 2 --expected PASS --seed $((seed0 + k)) --out "$out/stream$k-$fam.jsonl" \
      > "$out/stream$k.txt" 2>&1 &
  done
done
wait
{
  echo "== streams (seeds from $((seed0 + 1)))"
  for i in $(seq 1 "$k"); do tail -2 "$out/stream$i.txt"; done
} >> "$log" 2>&1
for fam in native avx2 default; do cat "$out"/stream*-"$fam".jsonl > "$out/$fam-$dtype.jsonl" 2>/dev/null; done
rm -f "$out"/stream*
