#!/usr/bin/env bash
# One prepared run on a lent NVIDIA machine (no network there): MLX's CUDA build from carried
# wheels, then, by MODE:
#   profiles (default)  bench/engine_loop.py on the demo llama (the engine ÷ the raw engine in
#                       one process: the loop's own share, without gRPC or a second process),
#                       then bench/step_profile.py (served ÷ raw, best of 3 alternating rounds,
#                       and py-spy in both worker processes), speculation on and off, and
#                       .gpu/before/ (an earlier commit's tree) first when present
#   sweeps              bench.py's quick sweep on the demo llama, speculation on and off
#   shapes              the quick sweep on random 4-bit llamas of real shape (SmolLM2-135M's, and
#                       Llama 3.2 1B's beside smg-grpc-servicer from .gpu/peer/)
# Tables go to stdout; everything else, as one tarball, to $OUT/gpu-results.tgz (rewritten after
# each part, so a run cut short still brings back what it finished).
#
# Carried (ignored folders; a call carries at most 64 MiB, the mlx-cuda-13 wheel alone is 90 MB,
# so a first call on the same warm machine copies its first half to /root):
#   /root/mlxcuda.part-aa   the first 52,000,000 bytes of mlx_cuda_13-0.32.4's wheel
#   .gpu/   mlxcuda.part-ab (the rest), whl/ (Python 3.12 wheels: mlx, mlx-lm, grpcio*,
#           protobuf, llguidance, msgspec, py-spy), cache/ (the demo llama); before/ (profiles),
#           smollm2/ (SmolLM2's tokenizer and config) and peer/ (smg-grpc-servicer,
#           smg-grpc-proto, mlx-lm 0.31) for shapes
#
#   first call:  cp .gpu1/mlxcuda.part-aa /root/            (carry .gpu1)
#   second call: bash bench/gpu_session.sh                  (carry .gpu; see bench/README.md)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
RES=/tmp/gpu-results
mkdir -p "$OUT" "$RES"
PY=python3
ROOT=$(pwd)
WHEEL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
LEVELS=${LEVELS:-1,8,32}

cat /root/mlxcuda.part-aa .gpu/mlxcuda.part-ab > "$WHEEL" || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile "$WHEEL" .gpu/whl/*.whl || exit 1
SITE=$($PY -c 'import site; print(site.getsitepackages()[0])')
LD_LIBRARY_PATH=$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/*/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH PYTHONPATH=$ROOT MLX_GRPC_WORKER_CACHE=$ROOT/.gpu/cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PATH=$(dirname "$(command -v $PY)"):$PATH  # py-spy's script beside python3
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

save() { tar czf "$OUT/gpu-results.tgz" -C "$RES" . 2>/dev/null; }
{
    date -u
    git -C "$ROOT" rev-parse HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)"
} | tee "$RES/machine.txt"
$PY - <<'PYEOF' 2>&1 | tee -a "$RES/machine.txt" || exit 1
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
save

sweep() {  # tag, seconds, then bench.py arguments
    local tag=$1 limit=$2
    shift 2
    echo "=== sweep $tag $(date -u +%T)"
    timeout "$limit" $PY bench/bench.py --quick --only sweep --levels "$LEVELS" --no-results-md \
        --out "$RES/$tag" --device-note "$DEVICE" "$@" 2>&1 | tee "$RES/$tag.log" | grep -v "^\[bench"
    save
}
profile() {  # tag, checkout, then step_profile.py arguments
    local tag=$1 tree=$2
    shift 2
    echo "=== profile $tag $(date -u +%T)"
    (cd "$tree" && PYTHONPATH=$tree timeout "${PROFILE_S:-100}" $PY bench/step_profile.py \
        --levels "$LEVELS" --rounds 3 --requests 8 --tokens 128 --out "$RES/$tag" "$@") 2>&1 |
        tee "$RES/$tag.log" | grep -v "^\[bench"
    save
}
loop() {  # tag, then engine_loop.py arguments
    local tag=$1
    shift
    echo "=== engine loop $tag $(date -u +%T)"
    timeout "${LOOP_S:-120}" $PY bench/engine_loop.py --levels "$LEVELS" --rounds 4 \
        --out "$RES/$tag" "$@" 2>&1 | tee "$RES/$tag.log"
    save
}
# Each new process compiles MLX's CUDA kernels on first use (30-70 s a process on a fresh
# machine): the bench's sweep starts two processes a level and needs ~3 minutes a worker;
# step_profile keeps its two up across levels and rounds (about a minute a run).
if [ "${MODE:-profiles}" = shapes ]; then  # random 4-bit llamas of real shape, one beside the peer
    build() {  # name layers hidden intermediate heads kv_heads
        $PY bench/fixtures.py random --out "/tmp/models/$1" --layers "$2" --hidden "$3" \
            --intermediate "$4" --heads "$5" --kv-heads "$6" --like .gpu/smollm2 || exit 1
    }
    build smol-shape 30 576 1536 9 3  # SmolLM2-135M's shape, 4-bit
    build llama-1b 16 2048 8192 32 8  # Llama 3.2 1B's shape, 4-bit
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
        sweep 1b 300 --model /tmp/models/llama-1b --side-by-side
    else
        echo "the peer does not import here: 1b without it"
        sweep 1b 240 --model /tmp/models/llama-1b
    fi
    sweep smol 240 --model /tmp/models/smol-shape
elif [ "${MODE:-profiles}" = sweeps ]; then
    sweep warm 150 --repeats 1 --min-seconds 1
    sweep demo 240 --repeats 3
    sweep demo-spec-off 240 --repeats 3 --worker-flags=--speculate\ off
else
    loop loop
    # .gpu/before: an earlier commit's tree (git archive), measured in the same run.
    [ -d .gpu/before ] && profile before "$ROOT/.gpu/before"
    profile after "$ROOT"
    profile after-spec-off "$ROOT" --flags="--speculate off"
fi
echo "=== done $(date -u +%T)"
