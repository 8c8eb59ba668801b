#!/usr/bin/env bash
# The GPU measurements in one go: GPU tests, then kvproto bench transfer, rooms and kernels, each
# writing its table to OUTDIR/<name>.txt and its figures to OUTDIR/<name>.json.
#
#   usage: benchmarks/gpu.sh OUTDIR [quick | kernel | hybrid | round2]
#
# Run from the repository root on a machine with one or two CUDA GPUs, with kvproto's
# dependencies importable (wheels in .whl/ are installed to /tmp/site first if present).
# Each step has its own time limit, so one slow step never loses the others' output.
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUTDIR [quick]}
quick=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v "NIXL INFO\|UCX AM send failed" | tee "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
nvidia-smi topo -m >>"$out/gpus.txt" 2>&1
if [ "$quick" = round2 ]; then
    step gpu-tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/aio/test_gpu.py tests/kernels -x
    step transfer 200 python3 -m kvproto.cli bench transfer --json "$out/transfer.json" --tp 1:1
    step transfer-tp 120 python3 -m kvproto.cli bench transfer --json "$out/transfer-tp.json" --tp 1:2 2:1 \
        --sizes-mib 128 1024 --paths auto
    step transfer-1g 60 python3 -m kvproto.cli bench transfer --json "$out/transfer-1g.json" --tp 1:1 \
        --sizes-mib 1024 --pages random --paths staged --staging-mib 1024
    step rooms 60 python3 -m kvproto.cli bench rooms --json "$out/rooms.json" --rooms 2000 --windows 1 64 512
    step kernels 80 python3 -m kvproto.cli bench kernels --layers 32 --tokens 1024 8192 --iters 5 --sweep --no-host
    exit 0
fi
kernel_path() {  # the kernel path (transport cuda-ipc) and NIXL beside it, random pages
    local b="python3 -m kvproto.cli bench transfer"
    step kernel-11 150 $b --transport cuda-ipc --json "$out/kernel-11.json" --tp 1:1 --sizes-mib 8 128 1024 \
        --pages random --paths auto
    step kernel-tp 150 $b --transport cuda-ipc --json "$out/kernel-tp.json" --tp 1:2 2:1 --sizes-mib 1024 \
        --pages random --paths auto
    step kernel-block64 80 $b --transport cuda-ipc --json "$out/kernel-block64.json" --tp 1:1 --sizes-mib 1024 \
        --pages random --paths auto --decode-block 64
    step kernel-hnd 80 $b --transport cuda-ipc --json "$out/kernel-hnd.json" --tp 1:1 --sizes-mib 1024 \
        --pages random --paths auto --decode-layout HND
    step kernel-latency 80 $b --transport cuda-ipc --json "$out/kernel-latency.json" --tp 1:1 --sizes-mib 8 \
        --pages random --paths auto --in-flight 1 --rooms 60
    step nixl-11 150 $b --transport nixl --json "$out/nixl-11.json" --tp 1:1 --sizes-mib 8 128 1024 \
        --pages random --paths auto
    step nixl-tp 150 $b --transport nixl --json "$out/nixl-tp.json" --tp 1:2 2:1 --sizes-mib 1024 \
        --pages random --paths auto
    step layers 150 python3 -m kvproto.cli bench layers --json "$out/layers.json" --transports nixl cuda-ipc \
        --layers 32 --tokens 1024 --compute-ms 1 --rooms 10
}
hybrid() {  # a GDN-shaped hybrid room against a one-group room of the same layers, both transports.
    # The kinds run interleaved (--interleave): both kinds' endpoints in the same rank processes,
    # their rooms in turns of a few hundred milliseconds or less, vs one the median over adjacent
    # turns. Whole runs taking turns (--repeat alone) spread by 20-50 %, up to 3x, on the H100 and
    # H200 hosts measured, whose cores run at full or half speed in spells (kvproto.bench.transfer).
    local b="python3 -m kvproto.cli bench transfer --pages random --paths auto --groups one hybrid"
    b="$b --tp 1:1 1:2 2:1"
    step hybrid-kernel-8 300 $b --interleave 150 --rooms 1950 --repeat 2 --transport cuda-ipc \
        --json "$out/hybrid-kernel-8.json" --sizes-mib 8
    step hybrid-kernel-128 300 $b --interleave 30 --rooms 1200 --transport cuda-ipc \
        --json "$out/hybrid-kernel-128.json" --sizes-mib 128  # 40 turn pairs: pages reused, checked per turn
    step hybrid-kernel-512 240 $b --interleave 8 --rooms 24 --repeat 4 --transport cuda-ipc \
        --json "$out/hybrid-kernel-512.json" --sizes-mib 512
    step hybrid-nixl-8 300 $b --interleave 100 --rooms 1000 --repeat 2 --transport nixl \
        --json "$out/hybrid-nixl-8.json" --sizes-mib 8
    step hybrid-nixl-128 300 $b --interleave 30 --rooms 120 --repeat 3 --transport nixl \
        --json "$out/hybrid-nixl-128.json" --sizes-mib 128
}
if [ "$quick" = hybrid ]; then
    hybrid
    exit 0
fi
if [ "$quick" = kernel ]; then
    step gpu-tests 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/aio/test_gpu.py tests/kernels \
        tests/transport/test_cuda_ipc_gpu.py
    kernel_path
    exit 0
fi
if [ "$quick" = quick ]; then
    step transfer 240 python3 -m kvproto.cli bench transfer --json "$out/transfer.json" --sizes-mib 128 1024 --tp 1:1 \
        --paths auto
    exit 0
fi
step gpu-tests 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/aio/test_gpu.py tests/kernels \
    tests/transport/test_cuda_ipc_gpu.py
kernel_path
hybrid
step transfer 300 python3 -m kvproto.cli bench transfer --json "$out/transfer.json"
step rooms 80 python3 -m kvproto.cli bench rooms --json "$out/rooms.json" --rooms 2000 --windows 1 64 512
step kernels 60 python3 -m kvproto.cli bench kernels --layers 32 --tokens 1024 8192 --iters 5
