#!/usr/bin/env bash
# One prepared run on a lent NVIDIA machine (no network there): MLX's CUDA build from carried
# wheels, then served ÷ raw sweeps on the demo llama and on random llamas of real shape (one
# beside smg-grpc-servicer's MLX servicer). Tables go to stdout, JSON to $OUT.
#
# Carried (ignored folders; a call carries at most 64 MiB, the mlx-cuda-13 wheel alone is 90 MB):
#   /root/whl/, /root/mlxcuda.part-aa   copied there by an earlier call on the same warm machine:
#           wheels for Python 3.12 (mlx, mlx-lm, grpcio*, protobuf, llguidance, msgspec) and the
#           first half of the mlx-cuda-13 wheel
#   .gpu/   mlxcuda.part-ab (the second half), cache/ (the demo llama), smollm2/ (SmolLM2's
#           tokenizer and config: a real 49,152-token vocabulary), peer/ (smg-grpc-servicer,
#           smg-grpc-proto, and mlx-lm 0.31 for the peer)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=python3
ROOT=$(pwd)
WHEEL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
LEVELS=${LEVELS:-1,8,32}

cat /root/mlxcuda.part-aa .gpu/mlxcuda.part-ab > "$WHEEL" || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile "$WHEEL" /root/whl/*.whl || exit 1
SITE=$($PY -c 'import site; print(site.getsitepackages()[0])')
LD_LIBRARY_PATH=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/*/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH PYTHONPATH=$ROOT MLX_GRPC_WORKER_CACHE=$ROOT/.gpu/cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY - <<'PYEOF' || exit 1
import time
import mlx.core as mx
print("mlx", mx.__version__, mx.default_device())
a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
mx.eval(a @ a)
t = time.perf_counter()
for _ in range(10):
    mx.eval(a @ a)
print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s")
PYEOF

build() {  # name layers hidden intermediate heads kv_heads
    $PY bench/fixtures.py random --out "/tmp/models/$1" --layers "$2" --hidden "$3" \
        --intermediate "$4" --heads "$5" --kv-heads "$6" --like .gpu/smollm2 || exit 1
}
build smol-shape 30 576 1536 9 3  # SmolLM2-135M's shape, 4-bit
build llama-1b 16 2048 8192 32 8  # Llama 3.2 1B's shape, 4-bit

sweep() {  # tag, then bench.py arguments
    local tag=$1
    shift
    echo "=== sweep $tag"
    timeout 200 $PY bench/bench.py --quick --only sweep --levels "$LEVELS" --no-results-md \
        --out "/tmp/bench-$tag" --device-note "$DEVICE" "$@"
    cp /tmp/bench-"$tag"/*.json "$OUT/$tag.json" 2>/dev/null
}
sweep demo

# The peer in its own folder (it wants mlx-lm < 0.32), reached through the bench's side venv.
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer .gpu/peer/*.whl
mkdir -p bench/.venv-smg/bin
printf '#!/usr/bin/env bash\nPYTHONPATH=/tmp/peer exec %s "$@"\n' "$(command -v $PY)" \
    > bench/.venv-smg/bin/python
chmod +x bench/.venv-smg/bin/python
MLX_VERSION=$($PY -c 'import importlib.metadata as m; print(m.version("mlx"))')
printf 'smg-grpc-servicer[mlx]==0.14.1\nmlx[cuda13]==%s\n' "$MLX_VERSION" \
    > bench/.venv-smg/.bench-requirements
if bench/.venv-smg/bin/python -c "import smg_grpc_servicer.mlx.server"; then
    sweep 1b --model /tmp/models/llama-1b --side-by-side
else
    echo "the peer does not import here: 1b without it"
    sweep 1b --model /tmp/models/llama-1b
fi
sweep smol --model /tmp/models/smol-shape
ls -la "$OUT"
