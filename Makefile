# lorafleet — the two commands are `make run` and `make test`; everything else serves them.
SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTO_SRC := $(wildcard protos/lorafleet/v1/*.proto)
PROTO_STAMP := protos/lorafleet/v1/.generated
SETUP_STAMP := $(VENV)/.installed

.PHONY: setup proto test lint helm-lint run bench clean reliability

setup: $(SETUP_STAMP) $(PROTO_STAMP)

# Re-installs only when the pins change; `pip install -e .` makes `lorafleet` a console script.
$(SETUP_STAMP): requirements.txt requirements-test.txt pyproject.toml
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
	$(PY) benchmarks/control_plane.py

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
