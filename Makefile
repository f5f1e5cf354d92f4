# Two commands on a fresh machine:
#   make tune MODEL=resnet50     the whole pipeline (creates .venv and installs the pins first)
#   make test                    the linter (ruff), then the test suite
# Options: TARGET=auto|llvm|cuda|cuda:sm_90  PRECISION=fp32|tf32|fp16  ACCUMULATE=fp32|fp16  BUCKETS=1,8,32
#          DIMS="seq=64,128" (lengths of a dimension the config declares, docs/shapes.md)
#          TRIALS=N  BUDGET=10m  MAX_TASKS=N  WORKDIR=dir  UNTUNED=1 (time an untuned copy too)
#          ALTERNATIVES=torch-eager,torch-compile,onnxruntime|none (timed beside the package; default torch-eager)  EXTRA="--any --cli flags"
# PYTHON=python3 uses that interpreter as it is (no venv), e.g. on the GPU machine.
# Environment check (GPU, driver, CUDA toolkit, pins, databases; docs/diagnostics.md):
#   make doctor [PACKAGE=folder]      exit 1 when a row FAILs; PACKAGE: whether that package loads here
# Serving (after make tune, same MODEL/TARGET/PRECISION/WORKDIR, or PACKAGE=folder):
#   make serve MODEL=resnet50 [HOST=0.0.0.0 PORT=8000 EXTRA="--max-queue-delay-ms 1 --max-concurrency 64"]
#   make loadtest MODEL=resnet50 [CONCURRENCY=1,4,16,32,64 OUT=results/... EXTRA="--request-batch 8"]
# Latency table (after make tune, same variables):
#   make bench MODEL=resnet50 [RUNNERS=tvm,torch-eager-fp16,torch-compile ITERS=200 ROUNDS=5]
# Tuning on a pool of GPUs through TVM's RPC tracker (README "Tuning on a pool of GPUs"):
#   make rpc-tracker HOST=0.0.0.0 PORT=9190                                  once, on the build host
#   make rpc-server TRACKER=hostA:9190 RPC_KEY=h200 GPU=0 HOST=0.0.0.0       once per GPU, on its host
#   make tune MODEL=resnet50 TRACKER=hostA:9190 RPC_KEY=h200 [RPC_LANES=N RPC_LANE_CPUS=N]   builds here, measures there
#   make rpc-status TRACKER=hostA:9190 RPC_KEY=h200                          the servers and their GPUs
#   make tune MODEL=resnet50 RPC_LANES=1      no TRACKER: one tuning process (default on a GPU machine with 8+ CPUs: two lanes, loopback pool)

MODEL     ?= resnet50
TARGET    ?=
PRECISION ?=
ACCUMULATE ?=
BUCKETS   ?=
DIMS      ?=
TRIALS    ?=
BUDGET    ?=
MAX_TASKS ?=
WORKDIR   ?=
EXTRA     ?=
PACKAGE   ?=
HOST      ?=
PORT      ?=
CONCURRENCY ?=
OUT       ?=
TRACKER   ?=
RPC_KEY   ?=
RPC_LANES ?=
RPC_LANE_CPUS ?=
GPU       ?=
PYTEST_ARGS ?=

VENV := .venv
ifeq ($(origin PYTHON), undefined)
PY := $(VENV)/bin/python
DEPS := $(VENV)/.installed
else
PY := $(PYTHON)
DEPS :=
endif

ARGS := --model $(MODEL) \
	$(if $(TARGET),--target $(TARGET)) \
	$(if $(PRECISION),--precision $(PRECISION)) \
	$(if $(ACCUMULATE),--accumulate $(ACCUMULATE)) \
	$(if $(BUCKETS),--buckets $(BUCKETS)) \
	$(if $(DIMS),--dim-buckets "$(DIMS)") \
	$(if $(TRIALS),--trials $(TRIALS)) \
	$(if $(BUDGET),--budget $(BUDGET)) \
	$(if $(MAX_TASKS),--max-tasks $(MAX_TASKS)) \
	$(if $(WORKDIR),--workdir $(WORKDIR)) \
	$(EXTRA)

# serve/loadtest find the package as the other targets find their workdir (or take PACKAGE).
SERVE_ARGS := $(if $(PACKAGE),--package $(PACKAGE),--model $(MODEL)) \
	$(if $(TARGET),--target $(TARGET)) \
	$(if $(PRECISION),--precision $(PRECISION)) \
	$(if $(WORKDIR),--workdir $(WORKDIR)) \
	$(if $(HOST),--host $(HOST)) \
	$(if $(PORT),--port $(PORT))

RPC_ARGS := $(if $(TRACKER),--tracker $(TRACKER)) $(if $(RPC_KEY),--rpc-key $(RPC_KEY)) $(if $(RPC_LANES),--rpc-lanes $(RPC_LANES)) $(if $(RPC_LANE_CPUS),--rpc-lane-cpus $(RPC_LANE_CPUS))

.PHONY: tune profile bench serve loadtest rpc-tracker rpc-server rpc-status doctor test lint install clean

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

install: $(DEPS)

tune: $(DEPS)
	$(PY) -m deploy run $(ARGS) $(RPC_ARGS) $(if $(UNTUNED),--untuned) $(if $(ALTERNATIVES),--alternatives $(ALTERNATIVES))

bench: $(DEPS)
	$(PY) -m deploy bench $(ARGS) $(if $(RUNNERS),--runners "$(RUNNERS)") $(if $(ITERS),--iters $(ITERS)) $(if $(ROUNDS),--rounds $(ROUNDS))

profile: $(DEPS)
	$(PY) -m deploy profile $(ARGS)

serve: $(DEPS)
	$(PY) -m deploy serve $(SERVE_ARGS) $(EXTRA)

loadtest: $(DEPS)
	$(PY) -m deploy loadtest $(SERVE_ARGS) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY)) $(if $(OUT),--out $(OUT)) $(EXTRA)

rpc-tracker: $(DEPS)
	$(PY) -m deploy rpc-tracker $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

rpc-server: $(DEPS)
	$(PY) -m deploy rpc-server $(if $(TRACKER),--tracker $(TRACKER)) $(if $(RPC_KEY),--key $(RPC_KEY)) \
		$(if $(GPU),--gpu $(GPU)) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(EXTRA)

rpc-status: $(DEPS)
	$(PY) -m deploy rpc-status $(if $(TRACKER),--tracker $(TRACKER)) $(if $(RPC_KEY),--rpc-key $(RPC_KEY))

doctor: $(DEPS)
	$(PY) -m deploy doctor $(if $(PACKAGE),--package $(PACKAGE)) $(EXTRA)

# Tests that are not timing-sensitive run on every core; the `serial` ones
# (tuning, serving: time-outs, load, hung servers) run after them, alone.
# Exit 5 (nothing selected, e.g. PYTEST_ARGS="-k name") is not a failure.
# The parallel workers fill the cores already: one TVM thread each (TVM's pool
# on every core, per worker, spins against the other worker's).
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test: $(DEPS) lint
	TVM_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not serial" $(PYTEST_ARGS) tests || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) tests || [ $$? -eq 5 ]

lint: $(DEPS)
	$(PY) -m ruff check deploy models tests scripts

clean:
	rm -rf artifacts
