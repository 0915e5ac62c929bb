#!/usr/bin/env bash
# Packs what FLA's fla.layers and fla.models need on the GPU machine beyond ../shared/gpu/prepare.sh's
# packages: flash-linear-attention 0.6.0 and transformers with the modules it imports (found by importing
# fla.models and fla.layers with nothing else installed), for CPython 3.12 on x86-64, into .gpu/.
# Usage, from the project root, after prepare.sh:  bash scripts/pack_fla_models.sh
# Then on the GPU machine:  source .gpu/env.sh && source .gpu/fla_models.sh && python -m ...
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -s .gpu/env.sh ] || { echo "run ../shared/gpu/prepare.sh first"; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/whl" \
  flash-linear-attention==0.6.0 transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 \
  safetensors==0.8.0 regex==2026.12.2 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 truststore==0.10.5 \
  pyyaml==6.0.4 tqdm==4.70.1
mkdir -p "$tmp/site"
for w in "$tmp"/whl/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
rm -rf "$tmp"/site/*.data  # flash-linear-attention's wheel holds fla/layers and fla/models only: fla-core's fla stays
# transformers' 500 model folders are 45 of its 78 MB and fla.models imports none of them (only auto, which
# registers FLA's configs): without them the pack fits the device's 64 MiB beside .gpu/site.tar.xz
find "$tmp/site/transformers/models" -mindepth 1 -maxdepth 1 -type d ! -name auto -exec rm -rf {} +
tar -C "$tmp/site" -cf - . | xz -T0 -6 > .gpu/fla_models.tar.xz
cat > .gpu/fla_models.sh <<'ENV'
# source after .gpu/env.sh: adds flash-linear-attention's layers and models, and transformers
if [ ! -d /tmp/gpu-site/transformers ]; then
  python3 -c "import tarfile; tarfile.open('.gpu/fla_models.tar.xz').extractall('/tmp/gpu-site')"
fi
ENV
ls -la .gpu/fla_models.tar.xz
