# Two entry points: `make serve` (local PD cluster on the default model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-beside-busy-neighbour lint format bench gpu-wheels

$(STAMP): setup.cfg pyproject.toml $(wildcard pdserve/kernels/csrc/*.cpp pdserve/kernels/csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first, so nothing below pulls a multi-GB CUDA wheel.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	# Compile the C++ CPU kernels (matmul, decode attention, norms) once now, so servers and tests only load them.
	$(BIN)/python -m pdserve.kernels.cpu_gemm
	touch $(STAMP)

# The default model (SmolLM2-135M-Instruct, a 98 MB GGUF) is fetched once into ~/.cache/pdserve/models;
# offline, the install still succeeds and `make serve` falls back to the demo model, saying why.
install: $(STAMP)
	@$(BIN)/pdserve fetch-model || echo "make install: no default model fetched (see above); make serve will serve the demo model"

serve: install
	$(BIN)/pdserve up

lint: install
	$(BIN)/ruff check pdserve tests bench
	$(BIN)/ruff format --check pdserve tests bench

format: install
	$(BIN)/ruff format pdserve tests bench
	$(BIN)/ruff check --fix pdserve tests bench

test: lint
	$(BIN)/python -m pytest -q --durations=15

# The whole suite beside a CPU-bound neighbour (a busy loop holding one of the cores), as CI's
# shared machines may be: the suite must pass as it is, waiting on conditions, never on timing.
test-beside-busy-neighbour: install
	$(PYTHON) -c "while True: pass" & busy=$$!; \
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=10; rc=$$?; kill $$busy; exit $$rc

bench: install
	$(BIN)/python bench/fsm_bench.py
	$(BIN)/python bench/transfer.py
	$(BIN)/python bench/model_bench.py
	$(BIN)/python bench/pd_compare.py

# Wheels a GPU machine without network lacks (CPython 3.12, x86-64), into the ignored .whl/ that
# travels with the tree; docs/gpu.md has the device command that installs them. With the device
# image's packages (bench/device_image_packages.txt) they must cover setup.cfg's runtime
# requirements: tests/test_gpu_packages.py checks that, reading the list below.
GPU_WHEELS ?= .whl
GPU_PLATFORMS := $(foreach p,manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))
gpu-wheels: install
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS) nixl-cu13==1.5.1 nixl==1.5.1 orjson==3.13.0 transitions==0.9.3 pytest-asyncio==1.5.0 llguidance==1.9.1 gguf==0.19.0
	du -sh $(GPU_WHEELS)
