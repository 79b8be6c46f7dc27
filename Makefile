# The two commands a newcomer runs: `make serve` and `make test`.
# Everything is installed into .venv from the pins in pyproject.toml.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
MODEL_REPOSITORY ?= model_repository
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup serve warm test perf bench clean

# Idempotent: reinstalls only when pyproject.toml changes.
setup: $(STAMP)
	@dpkg -s libb64-0d >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libb64-0d; }
	@$(PY) -m opara_core.serving.launcher prepare >/dev/null

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[server,test]'
	@rm -f $(VENV)/.installed-* && touch $@

# Foreground server on 127.0.0.1; ports from HTTP_PORT, GRPC_PORT, METRICS_PORT;
# more tritonserver flags from TRITON_ARGS (e.g. TRITON_ARGS="--metrics-interval-ms 500";
# a flag the launcher owns, such as a port, is refused). A line per model as it
# loads, one when the server is ready.
serve: setup
	exec $(PY) -m opara_core.serving.launcher serve --model-repository $(MODEL_REPOSITORY)

# Load every model of MODEL_REPOSITORY once, as `make serve` would, and stop:
# fills the build caches (Inductor's compiled code for fused lanes, under
# $$OPARA_CACHE_DIR or ~/.cache/opara) before the server starts, e.g. in a
# container image build. Free ports: a running server is no obstacle.
warm: setup
	$(PY) -m opara_core.serving.launcher warm --model-repository $(MODEL_REPOSITORY)

# The suite in TEST_WORKERS processes (default: the cores, at most 4; pytest-xdist),
# each test file whole in one of them and every test of the session's shared server
# in the same one (tests/conftest.py); TEST_WORKERS=0 runs it in this process.
# Each worker and the servers it starts get their share of the cores as torch's
# threads (OMP_NUM_THREADS, unless set): more threads than cores spin-wait.
# nginx (Debian's package) for the tests of the container's HTTP guard.
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)
test: setup
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nginx; }
	$(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$(( ($$(nproc) + $(TEST_WORKERS) - 1) / $(TEST_WORKERS) ))}) \
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) $(PYTEST_ARGS)

# perf_analyzer (bundled in tritonclient) against a running server (`make serve`):
# a concurrency sweep with count windows sized to each model's speed for every
# model of MODEL_REPOSITORY (named here, since listing a server's models needs
# the admin key; decoupled ones, gpt2, are skipped with a note), perf_analyzer's
# output streamed, one CSV per model in out/perf/. A level that does not settle
# is measured once more without the stability check and marked Settled=no.
# PERF_URL is the gRPC HOST:PORT; PERF_MODELS picks models; PERF_ARGS adds
# options of `python -m client.perf run` (e.g. "--max-trials 40 --rough-windows 0"
# for settled numbers only). PERF_SHM: none, system or cuda (perf_analyzer's
# --shared-memory; cuda on the server's GPU host: the tensors never touch the host).
# `.venv/bin/opara-perf-analyzer` runs perf_analyzer by hand.
PERF_URL ?= localhost:8001
PERF_MODELS ?= $(notdir $(patsubst %/config.pbtxt,%,$(wildcard $(MODEL_REPOSITORY)/*/config.pbtxt)))
PERF_ARGS ?=
PERF_SHM ?= none
perf: setup
	$(PY) -m client.perf run --url $(PERF_URL) --out-dir out/perf --shared-memory $(PERF_SHM) $(addprefix --model ,$(PERF_MODELS)) $(PERF_ARGS)

clean:
	rm -rf .triton .pytest_cache .hypothesis
