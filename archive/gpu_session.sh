#!/usr/bin/env bash
# One GPU session's work in one command: every stage's gpu and compile tests, the benchmark, and with
# stage 5 its kernels timed alone and the prepare kernel's ncu profile.
# Usage on a CUDA machine, from the repository root:  bash benchmarks/gpu_session.sh OUT_DIR [STAGES]
# Writes OUT_DIR/gpu_tests.log, OUT_DIR/bench.log and the benchmark's bench.csv, precision.csv, meta.json;
# back on the course machine, `python -m benchmarks.merge OUT_DIR && course regenerate` puts them on the pages.
# OUT_DIR/s05_kernel_parts.txt and s05_prepare_ncu.txt replace those in benchmarks/results (keep the
# ncu output of the version they replace under a new name in benchmarks/profile_s05.PROFILES).
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [s01,s02,...]}
stages=${2:-s01,s02,s03,s04,s05}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu_tests.log"
for stage in ${stages//,/ }; do
  test_file=$(ls tests/test_${stage}_*.py 2>/dev/null | head -1)
  [ -n "$test_file" ] || { echo "== $stage: no test file" | tee -a "$out/gpu_tests.log"; continue; }
  # the tests every stage shares (tests/test_stages.py) are selected by the stage's name
  echo "== python -m pytest $test_file tests/test_stages.py -k $stage -m 'gpu or compile' -v -s --target=solutions -p no:cacheprovider" | tee -a "$out/gpu_tests.log"
  python -m pytest "$test_file" tests/test_stages.py -k "$stage" -m "gpu or compile" -v -s --target=solutions -p no:cacheprovider 2>&1 \
    | grep -v "TileLang begins\|TileLang completes" | tee -a "$out/gpu_tests.log" | tail -3
done
python -m pytest tests/exercises -m gpu -v -s --target=solutions -p no:cacheprovider 2>&1 \
  | grep -v "TileLang begins\|TileLang completes" | tee -a "$out/gpu_tests.log" | tail -3
python -m benchmarks.bench --stages "$stages" --out "$out" 2>&1 | grep -v "TileLang begins\|TileLang completes" | tee "$out/bench.log" | tail -40
if [[ ",$stages," == *",s05,"* ]]; then
  python -c "from benchmarks.profile_s05 import time_each_kernel; time_each_kernel()" 2>&1 \
    | grep -v "TileLang begins\|TileLang completes" | tee "$out/s05_kernel_parts.txt"
  if command -v ncu >/dev/null; then
    $(python -c "from benchmarks.profile_s05 import NCU_COMMAND; print(NCU_COMMAND)") 2>&1 \
      | grep -v "^==PROF==" > "$out/s05_prepare_ncu.txt"
  else
    echo "ncu not found: no profile" | tee -a "$out/gpu_tests.log"
  fi
fi
