#!/usr/bin/env bash
# The device check, prepared for a session that is lent an accelerator (this project's device tool: one
# NVIDIA H200 at present). It runs our checks and the peer benchmark in one call, so their figures sit side by side.
#
# Here, on the development machine, first (about 25 minutes on two cores):
#   cargo xtask setup-cuda                                              # LLVM 23 for burn's cuda feature
#   cargo build --release -p pipeline-zimage --features cuda --example gpu_check
#   echo /.gpu/ >> .git/info/exclude && mkdir -p .gpu
#   cp target/release/examples/gpu_check .gpu/ && xz -T0 -9 .gpu/gpu_check     # about 130 MB -> under 30 MB
#   cp -r ../shared/gpu .gpu/peer                                       # the peer benchmark and its wheels
# Then call the device tool's `run` with carry [".gpu"] and the command `bash tools/gpu-check.sh`, timeout 540.
# The tiny checkpoint and goldens travel with the working tree (crates/pipeline-zimage/tests/fixtures).
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
[ -f .gpu/gpu_check ] || xz -d -k .gpu/gpu_check.xz
chmod +x .gpu/gpu_check
# The binary finds its fixtures through the path it was built at; point it at this checkout instead.
export CARGO_MANIFEST_DIR="$PWD/crates/pipeline-zimage"

echo "== parity of the tiny checkpoint on cuda:0 (goal: max abs error <= 1e-3 per golden)"
timeout 120 .gpu/gpu_check parity --device cuda:0 2>&1 | tee "$out/parity.txt"

echo "== our readings on cuda:0 (burn's pool and the driver's cuMemGetInfo) beside nvidia-smi's, the tiny pipeline"
echo "   under auto offload with no card, then under a hard 16GB cap over the real card"
nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,nounits | tee "$out/smi-before.txt"
timeout 120 .gpu/gpu_check readings --device cuda:0 --cap 16GB 2>&1 | tee "$out/readings.txt"
nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,nounits | tee "$out/smi-after.txt"

echo "== ours: the transformer at real size, bf16, resident and group offload under a hard 16GB cap over the card"
timeout 240 .gpu/gpu_check bench --device cuda:0 --cap 16GB --size 1024 --steps 6 2>&1 | tee "$out/ours.jsonl"

echo "== the peer: diffusers' own offloading of the same transformer"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/peer/wheels/*.whl && export PYTHONPATH=/tmp/site
PYTHONUNBUFFERED=1 timeout 240 python3 .gpu/peer/diffusers_zimage_offload_bench.py --cap 16GB --size 1024 --steps 6 2>&1 | tee "$out/peer.jsonl"
