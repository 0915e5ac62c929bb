# install_torch PYTHON: torch, pinned, into PYTHON's environment (scripts/setup.sh sources this file).
# Where an NVIDIA GPU is present (nvidia-smi lists one), the default index's build, which is CUDA's on
# Linux. Elsewhere the CPU build, from PyTorch's CPU wheel index: left to the default index, a Linux
# machine gets the CUDA build and several GB of CUDA libraries it cannot use. Where that index cannot
# be reached (a network that reaches only PyPI), the default index at once, with a line saying so.
TORCH_REQUIREMENT="torch==2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
TORCH_INDEX_SECONDS=10

install_torch() {
  local python=$1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "setup: an NVIDIA GPU is present: torch's default build (CUDA)"
    "$python" -m pip install -q "$TORCH_REQUIREMENT"
  elif "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))" \
      "$TORCH_CPU_INDEX/torch/" "$TORCH_INDEX_SECONDS" >/dev/null 2>&1; then
    echo "setup: no NVIDIA GPU: torch's CPU build, from $TORCH_CPU_INDEX"
    "$python" -m pip install -q "$TORCH_REQUIREMENT" --index-url "$TORCH_CPU_INDEX"
  else
    echo "setup: no NVIDIA GPU, but $TORCH_CPU_INDEX cannot be reached: torch from the default index" \
         "(a CUDA build on Linux: several GB)"
    "$python" -m pip install -q "$TORCH_REQUIREMENT"
  fi
}
