#!/usr/bin/env bash
# Runs one command on the lent GPU machine with the caches a CPU precompile and earlier calls left, and
# packs what it wrote into one file (the device sends back a few files only). From the project root:
#
#   bash scripts/device_run.sh [--tilelang TAR] [--triton TAR] -- COMMAND ...
#
# --tilelang TAR  TileLang's cache compiled ahead on the CPU (CONTRIBUTING.md, "Sparing the GPU's time"),
#                 packed from inside its folder (`tar -C DIR -cJf TAR .`): unpacked to /tmp/tlcache (the
#                 scratch folder is DEVICE_RUN_SCRATCH, /tmp unless set),
#                 which TILELANG_CACHE_DIR names before Python starts.
# --triton TAR    Triton's cache from an earlier call's results: triton.tgz (FLA's kernels compiled and
#                 autotuned) or triton_autotune.tgz (the autotuning's results alone: Triton then skips
#                 timing every config and only compiles the best). May be given more than once.
# COMMAND runs after `source .gpu/env.sh` (and .gpu/fla_models.sh where it was carried), with RUN_OUT set
# to a scratch folder for its results. $OUT then holds results.tar.gz (RUN_OUT), triton.tgz (the
# Triton cache, packed with gzip under a 30 s limit: xz ran a call into its limit once; often past the
# 16 MiB the device sends back) and triton_autotune.tgz (its *.autotune.json files, kilobytes, in
# their folders: what spares the next call FLA's autotuning). The script exits with COMMAND's status.
set -uo pipefail
tilelang= triton=()
while [ $# -gt 0 ]; do
  case $1 in
    --tilelang) tilelang=$2; shift 2 ;;
    --triton) triton+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "device_run: unknown option $1 (usage: see the script's head)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "device_run: no command after --" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "device_run: OUT is not set (the device sets it)" >&2; exit 2; }
source .gpu/env.sh
[ -f .gpu/fla_models.sh ] && source .gpu/fla_models.sh
scratch=${DEVICE_RUN_SCRATCH:-/tmp}  # where the caches and RUN_OUT live (a test points it elsewhere)
mkdir -p "$scratch/tlcache" "$scratch/triton"
[ -n "$tilelang" ] && tar -C "$scratch/tlcache" -xf "$tilelang"
for tar in ${triton[@]+"${triton[@]}"}; do tar -C "$scratch/triton" -xzf "$tar"; done
export TILELANG_CACHE_DIR=$scratch/tlcache TRITON_CACHE_DIR=$scratch/triton RUN_OUT=$scratch/run_out
mkdir -p "$RUN_OUT"
start=$(date +%s)
bash -c "$*" 2>&1 | tee "$RUN_OUT/device_run.log"
status=${PIPESTATUS[0]}
echo "device_run: exit $status after $(( $(date +%s) - start )) s" | tee -a "$RUN_OUT/device_run.log"
tar -C "$RUN_OUT" -czf "$OUT/results.tar.gz" .
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/triton_autotune.tgz" -T -)
timeout 30 tar -C "$TRITON_CACHE_DIR" -czf "$OUT/triton.tgz" . || echo "device_run: Triton's cache not packed in 30 s"
exit "$status"
