#!/usr/bin/env bash
# The device check, prepared for a session that is lent an accelerator (this project's device tool: one
# NVIDIA H200 at present). It runs our checks and the peer benchmark in one call, so their figures sit side by side.
#
# Here, on the development machine, first (about 25 minutes on two cores; `docs/benchmarks.md` has the figures):
#   cargo xtask gpu-bundle      # LLVM for burn's cuda feature, the CUDA release build of examples/gpu_check,
#                               # and .gpu/gpu-bundle.tar.xz: the binary and ../shared/gpu's peer benchmark
# Then call the device tool's `run` with carry [".gpu"] and the command `bash tools/gpu-check.sh`, timeout 560.
# Nothing is built there; the steps' timeouts add up to 500 s, so one call fits the device's 10-minute limit.
# The tiny checkpoint and goldens travel with the working tree (crates/pipeline-zimage/tests/fixtures).
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if [ ! -f .gpu/gpu_check ]; then
  [ -f .gpu/gpu-bundle.tar.xz ] || { echo "no .gpu/gpu-bundle.tar.xz: run cargo xtask gpu-bundle here, then carry .gpu" >&2; exit 2; }
  tar -C .gpu -xJf .gpu/gpu-bundle.tar.xz
fi
chmod +x .gpu/gpu_check
# The binary finds its fixtures through the path it was built at; point it at this checkout instead.
export CARGO_MANIFEST_DIR="$PWD/crates/pipeline-zimage"

echo "== parity of the tiny checkpoint on cuda:0 (goal: max abs error <= 1e-3 per golden)"
timeout 60 .gpu/gpu_check parity --device cuda:0 2>&1 | tee "$out/parity.txt"

echo "== our readings on cuda:0 (burn's pool and the driver's cuMemGetInfo) beside nvidia-smi's, the tiny pipeline"
echo "   under auto offload with no card, then under a hard 16GB cap over the real card"
nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,nounits | tee "$out/smi-before.txt"
timeout 60 .gpu/gpu_check readings --device cuda:0 --cap 16GB 2>&1 | tee "$out/readings.txt"
nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,nounits | tee "$out/smi-after.txt"

echo "== ours: the transformer at real size, bf16, resident and group offload under a hard 16GB cap over the card"
timeout 180 .gpu/gpu_check bench --device cuda:0 --cap 16GB --size 1024 --steps 6 2>&1 | tee "$out/ours.jsonl"

echo "== the peer: diffusers' own offloading of the same transformer"
timeout 20 python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/peer/wheels/*.whl && export PYTHONPATH=/tmp/site
PYTHONUNBUFFERED=1 timeout 180 python3 .gpu/peer/diffusers_zimage_offload_bench.py --cap 16GB --size 1024 --steps 6 2>&1 | tee "$out/peer.jsonl"
