#!/usr/bin/env bash
# Runs one command on the lent GPU machine with the caches a CPU precompile and earlier calls left, and
# packs what it wrote into one file (the device sends back a few files only). From the project root:
#
#   bash scripts/device_run.sh [--tilelang TAR] [--triton TAR] -- COMMAND ...
#
# --tilelang TAR  TileLang's cache compiled ahead on the CPU (CONTRIBUTING.md, "Sparing the GPU's time"),
#                 packed from inside its folder (`tar -C DIR -cJf TAR .`): unpacked to /tmp/tlcache,
#                 which TILELANG_CACHE_DIR names before Python starts.
# --triton TAR    Triton's cache (FLA's kernels compiled and autotuned) from an earlier call's results.
# COMMAND runs after `source .gpu/env.sh` (and .gpu/fla_models.sh where it was carried), with RUN_OUT set
# to a scratch folder for its results. $OUT then holds results.tar.gz (RUN_OUT) and triton.tgz (the
# Triton cache, packed with gzip under a 30 s limit: xz ran a call into its limit once). The script
# exits with COMMAND's status.
set -uo pipefail
tilelang= triton=
while [ $# -gt 0 ]; do
  case $1 in
    --tilelang) tilelang=$2; shift 2 ;;
    --triton) triton=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "device_run: unknown option $1 (usage: see the script's head)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "device_run: no command after --" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "device_run: OUT is not set (the device sets it)" >&2; exit 2; }
source .gpu/env.sh
[ -f .gpu/fla_models.sh ] && source .gpu/fla_models.sh
mkdir -p /tmp/tlcache /tmp/triton
[ -n "$tilelang" ] && tar -C /tmp/tlcache -xf "$tilelang"
[ -n "$triton" ] && tar -C /tmp/triton -xzf "$triton"
export TILELANG_CACHE_DIR=/tmp/tlcache TRITON_CACHE_DIR=/tmp/triton RUN_OUT=/tmp/run_out
mkdir -p "$RUN_OUT"
start=$(date +%s)
bash -c "$*" 2>&1 | tee "$RUN_OUT/device_run.log"
status=${PIPESTATUS[0]}
echo "device_run: exit $status after $(( $(date +%s) - start )) s" | tee -a "$RUN_OUT/device_run.log"
tar -C "$RUN_OUT" -czf "$OUT/results.tar.gz" .
timeout 30 tar -C /tmp/triton -czf "$OUT/triton.tgz" . || echo "device_run: Triton's cache not packed in 30 s"
exit "$status"
