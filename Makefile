# trainyard — everything a fresh machine needs goes through these targets.
SHELL := /bin/bash
.DEFAULT_GOAL := venv

PYTHON   ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.trainyard-installed
PACKAGES := libs/contract libs/runtime libs/planner libs/sdk libs/trainer libs/cli services/telemetry services/api services/scheduler services/node-agent services/checkpoint-coordinator services/registry
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))
PYTEST_ARGS ?=
# `make test` runs the suite in this many worker processes, a test file per worker at a time (its module-scoped
# stacks stay in one process; each worker starts its own broker and Redis). Most of the suite waits on brokers,
# subprocesses and ranks (two workers keep the 2 cores ~55% busy), but three were no faster here (779-858 s vs
# 828-860 s with two, across runs) and load the stacks' ranks more (more stragglers, slower starts). Handing out the
# long files first was slower too (1,036 s: the heavy files then run side by side). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2

.PHONY: venv deps up observe down logs status demo data lint test test-unit test-long chaos bench clean help

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

venv: $(STAMP) ## create .venv with every package editable (torch==2.13.0 CPU)

$(STAMP): $(PYPROJECTS) requirements-dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet $(addprefix -e ,$(PACKAGES)) -e 'libs/cli[dev]' -r requirements-dev.txt
	@touch $(STAMP)

deps: venv ## install system packages the local stack needs (redis-server; prometheus for make observe; MLflow in .tools)
	@scripts/ensure-system-deps.sh
	@scripts/ensure-mlflow.sh

up: deps ## start broker, redis, the five services and 2 node agents, publish the example dataset; print API URL + token
	$(BIN)/trainyard dev up

observe: deps ## make up, plus Prometheus scraping every service and node agent (rules: deploy/prometheus); prints its URL
	TRAINYARD_PROMETHEUS=1 $(BIN)/trainyard dev up

down: ## drain running jobs (they checkpoint and stop; they resume after 'make up'), then stop exactly what 'make up' started
	@if [ -x $(BIN)/trainyard ]; then $(BIN)/trainyard dev down; else echo "nothing to stop (no .venv)"; fi

logs: ## show the local stack's logs
	$(BIN)/trainyard dev logs

status: ## show what the local stack runs
	$(BIN)/trainyard dev status

data: venv ## build the example dataset (tinycorpus@v1) if needed
	$(BIN)/trainyard dev data

demo: up ## run the tiny example job end to end on the local stack
	$(BIN)/trainyard dev demo

lint: venv ## ruff (ruff.toml), mypy over libs/ and services/ (mypy.ini), the code-shape limits (class 300, function 80)
	$(BIN)/ruff check
	$(BIN)/mypy
	$(BIN)/python scripts/code_shape.py --check

test: deps lint ## install what is missing, start what tests need, lint and type-check, run the test suite
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

test-unit: venv ## unit tests only (no broker, no redis)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-long: deps ## the long runs: property-based and stateful, the long simulation, 50 Redis failovers under allocation load
	TRAINYARD_LONG_TESTS=1 $(BIN)/python -m pytest -m "long or not chaos" $(PYTEST_ARGS)

chaos: deps ## the chaos suite, long run
	TRAINYARD_LONG_TESTS=1 $(BIN)/python -m pytest -m chaos tests/chaos $(PYTEST_ARGS)

bench: deps ## run the benchmarks (ratios against a baseline measured in the same run)
	@for b in bench/*/run.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean: down ## remove local state (.trainyard/) — keeps .venv
	rm -rf .trainyard
