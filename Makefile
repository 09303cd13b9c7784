# mlx-grpc-worker: `make serve` to run the worker, `make test` to test it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Linux needs MLX's CPU backend; macOS gets Metal from plain mlx.
EXTRAS := $(if $(filter Darwin,$(shell uname -s)),dev,cpu,dev)
ARGS ?=

.PHONY: install serve test test-slow test-all lint format proto demo bench bench-images nightly fuzz-cache fuzz-requests families vision-families clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	# Images (the vision extra): mlx-vlm without its server, audio and video stack.
	$(BIN)/pip install --quiet --no-deps "mlx-vlm>=0.7.10,<0.8" && $(BIN)/pip install --quiet requests "av>=14"
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/mlx-grpc-worker $(ARGS)

# Test files in TEST_JOBS processes (most tests wait on servers, routers and subprocesses, so
# more processes than cores pay). `make test` leaves out the tests marked slow (the full runs of
# the long differential suites, each of which keeps a fast slice here); `make test-slow` runs
# only those, `make test-all` everything. An -m in ARGS replaces the target's.
TEST_JOBS ?= 4
PYTEST := $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile
test: $(STAMP)
	$(PYTEST) -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(PYTEST) -m slow $(ARGS)

test-all: $(STAMP)
	$(PYTEST) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: $(STAMP)
	$(BIN)/python proto/generate.py

demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(ARGS)

# Served vs raw-engine throughput, burst, cancel (ARGS="--quick", "--side-by-side", ...).
bench: $(STAMP)
	$(BIN)/python bench/bench.py $(ARGS)

# Mixed image and text traffic, ours (vLLM face) vs mlx_vlm.server on the same model
# (ARGS="--model shape" for a VLM of real shape; needs mlx_vlm.server's deps: bench/README.md).
bench-images: $(STAMP)
	$(BIN)/python bench/images.py $(ARGS)

# The router's PD mode (pull, shared) against one worker and two in regular mode, real models
# (ARGS="--model real --levels 1,8").
.PHONY: bench-pd
bench-pd: $(STAMP)
	$(BIN)/python bench/pd.py $(ARGS)

# genai-bench through the smg router, ours vs the raw engine (and smg-grpc-servicer with
# --side-by-side): fixed scenarios, a history, a verdict (exit 1 on a regression), trend PNGs and
# an HTML page (ARGS="--quick", "--history PATH"; an ad-hoc run: ARGS="--scenario 'D(2000,200)'
# --concurrency 1,4,8"). Installs genai-bench into bench/.venv-genai on first use.
nightly: $(STAMP)
	$(BIN)/python bench/nightly.py $(ARGS)

# Several LoRA adapters on one engine (issue 63): c = 8 spread over 4 adapters vs c = 8 on one
# and vs a worker without adapters, SmolLM2-135M-Instruct 4-bit (~12 minutes; ARGS="--profile").
.PHONY: bench-adapters
bench-adapters: $(STAMP)
	$(BIN)/python bench/adapters.py $(ARGS)

# Differential fuzz of the prompt cache: SEEDS seeds per demo kind (ARGS="--kinds hybrid").
SEEDS ?= 50
fuzz-cache: $(STAMP)
	$(BIN)/python tests/cache_fuzz.py --seeds $(SEEDS) $(ARGS)

# Differential fuzz of a prompt cache three workers share, restarts included (ARGS="--kinds hybrid").
.PHONY: fuzz-shared-cache
fuzz-shared-cache: $(STAMP)
	$(BIN)/python tests/shared_cache_fuzz.py --seeds $(SEEDS) $(ARGS)

# Request fuzz of both faces (--protocols mlx,vllm): SEEDS seeds of 300 mostly malformed
# requests on one demo llama (ARGS="--kinds llama,gemma3,hybrid", "--trace calls.jsonl").
fuzz-requests: $(STAMP)
	$(BIN)/python tests/request_fuzz.py --seeds $(SEEDS) $(ARGS)

# Differential fuzz of image prefixes and features: image and text requests at random, repeated
# images, cancellations, against a cache-off worker, on every served vision family (3 seeds each).
.PHONY: fuzz-images
fuzz-images: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow" -k without_any_cache tests/test_images_cache.py $(ARGS)

# Every mlx-lm text architecture (tiny random weights) served by the worker in six cells and
# compared with mlx-lm's greedy output: bench/families-table.md and the README's summary
# (ARGS="--only llama" redoes one and keeps the others from the last full run).
# A scheduled run writes elsewhere: FAMILY_OUT="--json DIR/f.json --markdown DIR/f.md" ARGS=--strict.
FAMILY_JOBS ?= 2
FAMILY_OUT ?= --json bench/families-results.json --markdown bench/families-table.md --readme README.md
families: $(STAMP)
	$(BIN)/python bench/families.py --jobs $(FAMILY_JOBS) $(FAMILY_OUT) $(ARGS)

# The vision-language families the worker serves images for (gemma3, mistral3, llava, qwen2_vl,
# qwen2_5_vl; the tiny demo checkpoints) in five cells against mlx-vlm's greedy output:
# bench/vision-families-table.md (a part, printed only: VISION_OUT= ARGS="--only llava --cells kv8").
VISION_OUT ?= --markdown bench/vision-families-table.md
vision-families: $(STAMP)
	$(BIN)/python bench/vision_families.py $(VISION_OUT) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
