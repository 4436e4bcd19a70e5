# lorafleet — the two commands are `make run` and `make test`; everything else serves them.
SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTO_SRC := $(wildcard protos/lorafleet/v1/*.proto)
PROTO_STAMP := protos/lorafleet/v1/.generated
SETUP_STAMP := $(VENV)/.installed
# The oldest Python the code runs on: pyproject.toml's requires-python (">=3.11" gives 3.11).
PY_MIN := $(shell sed -n 's/^requires-python = ">=\([0-9.]*\)"$$/\1/p' pyproject.toml)

.PHONY: setup proto test lint helm-lint run bench clean reliability

setup: $(SETUP_STAMP) $(PROTO_STAMP)

# Re-installs only when the pins change; `pip install -e .` makes `lorafleet` a console script.
# A Python older than PY_MIN stops here, before anything is installed.
$(SETUP_STAMP): requirements.txt requirements-test.txt pyproject.toml
	@py=$(PY_SYS); test -x $(PY) && py=$(PY); \
	$$py -c 'import sys; sys.exit(sys.version_info[:2] < tuple(map(int, "$(PY_MIN)".split("."))))' 2>/dev/null || { \
	  echo "lorafleet needs Python $(PY_MIN) or newer, but $$py is $$(command -v $$py >/dev/null && $$py --version 2>&1 || echo "not found")." \
	       "Install Python $(PY_MIN)+ and run: make setup PY_SYS=python$(PY_MIN)" \
	       "(after make clean if .venv was made by the older Python)" >&2; exit 1; }
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

proto: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) $(SETUP_STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
		--pyi_out=protos $(PROTO_SRC)
	@touch $@

test: setup helm-lint
	$(PY) -m pytest -q tests

# helm lint + template (default and helm/values/*) validated with kubernetes-validate; helm is fetched offline.
helm-lint: setup
	bash helm/lint.sh

lint: setup
	$(VENV)/bin/ruff check .

# The whole stack in the foreground: Redis, the control plane, one CPU pod with the demo adapters; Ctrl-C stops it.
run: setup
	$(VENV)/bin/lorafleet up

# The CPU benchmarks whose figures are in benchmarks/RESULTS.md (benchmarks/lora_kernels.py needs a GPU).
bench: setup
	$(PY) benchmarks/model_cpu.py
	$(PY) benchmarks/adapter_load.py
	$(PY) benchmarks/serve.py
	$(PY) benchmarks/cpu_matmul.py
	$(PY) benchmarks/step_trace.py
	for d in float32 bfloat16-matmul bfloat16; do $(PY) benchmarks/invariance_cost.py --dtype $$d; done
	$(PY) benchmarks/router.py
	$(PY) benchmarks/control_plane.py
	$(PY) benchmarks/control_plane_scale.py
	$(PY) benchmarks/fleet_sim.py --jobs 2 --plots benchmarks/plots

# The reliability suite at full size (60 s of load, 2,000 load/unload cycles, ...); its measured figures
# become docs/RELIABILITY.md. `make test` runs the same tests at reduced sizes.
RELIABILITY_RESULTS := build/reliability
reliability: setup
	rm -rf $(RELIABILITY_RESULTS)
	LORAFLEET_RELIABILITY=full LORAFLEET_RELIABILITY_RESULTS=$(CURDIR)/$(RELIABILITY_RESULTS) \
		$(PY) -m pytest -q -p no:cacheprovider tests/reliability
	$(PY) -m tests.reliability.report $(RELIABILITY_RESULTS) docs/RELIABILITY.md

clean:
	rm -rf $(VENV) protos/lorafleet/v1/*_pb2*.py protos/lorafleet/v1/*_pb2*.pyi $(PROTO_STAMP)
