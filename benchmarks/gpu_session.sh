#!/usr/bin/env bash
# One GPU session's work in one command: every stage's gpu and compile tests, then the benchmark.
# Usage on a CUDA machine, from the repository root:  bash benchmarks/gpu_session.sh OUT_DIR [STAGES]
# Writes OUT_DIR/gpu_tests.log, OUT_DIR/bench.log and the benchmark's bench.csv, precision.csv, meta.json;
# back on the course machine, `python -m benchmarks.merge OUT_DIR && course regenerate` puts them on the pages.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [s01,s02,...]}
stages=${2:-s01,s02,s03,s04,s05}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu_tests.log"
for stage in ${stages//,/ }; do
  test_file=$(ls tests/test_${stage}_*.py 2>/dev/null | head -1)
  [ -n "$test_file" ] || { echo "== $stage: no test file" | tee -a "$out/gpu_tests.log"; continue; }
  echo "== python -m pytest $test_file -m 'gpu or compile' -v -s --target=solutions -p no:cacheprovider" | tee -a "$out/gpu_tests.log"
  python -m pytest "$test_file" -m "gpu or compile" -v -s --target=solutions -p no:cacheprovider 2>&1 \
    | grep -v "TileLang begins\|TileLang completes" | tee -a "$out/gpu_tests.log" | tail -3
done
python -m pytest tests/exercises -m gpu -v -s --target=solutions -p no:cacheprovider 2>&1 \
  | grep -v "TileLang begins\|TileLang completes" | tee -a "$out/gpu_tests.log" | tail -3
python -m benchmarks.bench --stages "$stages" --out "$out" 2>&1 | grep -v "TileLang begins\|TileLang completes" | tee "$out/bench.log" | tail -40
