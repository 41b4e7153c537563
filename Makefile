# Two commands do everything on a fresh machine:
#   make run    set up, then run the main job
#   make test   set up, then run the whole test suite
# Set-up is idempotent: a stamp file records a finished install and is redone when pyproject.toml changes.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvgate-installed
# torch first, pinned: 2.13.0 resolves to the CPU build on disk; anything unpinned pulls several GB of CUDA.
TORCH_SPEC := torch==2.13.0
# Debian packages the tests need, as "command:package" pairs; installed only when the command is missing.
SYSTEM_DEPS := redis-server:redis-server chromium:chromium prometheus:prometheus promtool:prometheus \
  slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge g++:g++
PYTEST_ARGS ?=
# checkov scans the Dockerfile and the Helm chart in the tests. It pins an old boto3 and packaging, so it gets a
# venv of its own rather than downgrading kvgate's dependencies; pinned, since a new release adds checks and the
# tests list the exact findings they accept.
CHECKOV_SPEC := checkov==3.3.30
CHECKOV_VENV := $(VENV)/tools/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(subst ==,-,$(CHECKOV_SPEC))

.PHONY: run test setup system-deps proto clean help

help:
	@echo "make run     set up .venv and the system packages, then run kvgate's main job"
	@echo "make test    set up, then run the whole pytest suite (PYTEST_ARGS='-k foo' to narrow)"
	@echo "make proto   regenerate the gRPC stubs in kvgate/v1 from proto/"
	@echo "make clean   remove .venv and caches"

setup: $(STAMP) system-deps

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[engine,test]'
	@# setuptools leaves its build metadata at the root; the install itself lives in .venv (dist-info)
	rm -rf kvgate.egg-info build
	@touch $(STAMP)

$(CHECKOV_STAMP): | $(PY)
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet "$(CHECKOV_SPEC)"
	@touch $(CHECKOV_STAMP)

system-deps:
	@missing=""; \
	for pair in $(SYSTEM_DEPS); do \
	  cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  sudo=""; [ "$$(id -u)" -ne 0 ] && sudo="sudo"; \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# The main job: the whole stack on this box with the demo registry (Ctrl-C stops it and every replica).
run: setup
	$(VENV)/bin/kvgate up --registry examples/registry

# pytest exits 5 when it collected nothing: that is a broken set-up, not a pass.
test: setup $(CHECKOV_STAMP)
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; the set-up is broken" >&2; exit 1; fi; \
	exit $$rc

proto: $(STAMP)
	$(PY) -m kvgate.protogen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
