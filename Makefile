# kpx: two commands on a fresh machine, `make run` and `make test`.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
KPX   := $(VENV)/bin/kpx
STAMP := $(VENV)/.installed

.PHONY: setup run test lint down bench bench-quick clean compose-up compose-down

# setup.py and the C source too: `pip install -e` builds the relay core in place.
$(STAMP): pyproject.toml setup.py proxy/userspace/_relaycore.c
	bash .ci/system-deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

# Python's bytecode caches on, whatever the caller's environment says. Every
# process a lab or a test starts (kpx node, its pods, the LB, the CLI) imports
# kpx's own modules, and pytest rewrites every test module's asserts. Under
# PYTHONDONTWRITEBYTECODE (set on some CI runners) none of that is cached:
# each kpx start compiled its modules again (about 0.45 s here), and each
# pytest process spent about 10 s rewriting the tests before running one.
unexport PYTHONDONTWRITEBYTECODE

run: $(STAMP)
	$(KPX) lab up
	$(KPX) demo
	$(KPX) lab status
	@echo
	@echo "The default lab is up. Try:  $(KPX) lab exec client -- curl -s http://\$$($(KPX) lab lb-address)/"
	@echo "Remove it with:              make down"

down: $(STAMP)
	$(KPX) lab down

# Tests that time something the machine's load would stretch (a restart's
# handover window, 1 s apply deadlines, a UDP cadence) are marked serial; the
# compose lab (one per module, a shared image) is serial too.
SERIAL_TESTS = serial or compose

test: $(STAMP) lint
	# On both cores: everything else. The unit tests are pure; every bench
	# topology, dataplane test and lab has namespaces of its own (kb<pid>-*,
	# kl<pid>x<n>-*), and their drop checks wait out a silence, which load only
	# makes longer. Then the serial ones, with the machine to themselves.
	$(PY) -m pytest -q -n 2 -m "not ($(SERIAL_TESTS))"
	$(PY) -m pytest -q -m "$(SERIAL_TESTS)"

# ruff, then the import contracts in pyproject.toml: the pure core imports no
# I/O or shell, healthz nothing of proxy, lab and bench neither.
lint: $(STAMP)
	$(VENV)/bin/ruff check proxy healthz lab bench tests
	$(VENV)/bin/lint-imports

# The compose lab (docker-compose.yml) on whichever engine is present:
# `docker compose` when Docker answers, else podman-compose (see compose/README.md).
compose-up: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" compose/kpx-compose up -d --build
	@echo
	@echo "The compose lab is up. Try:  compose/kpx-compose exec client curl -s http://10.79.0.1/"
	@echo "Remove it with:              make compose-down"

compose-down: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" compose/kpx-compose down -v -t 1
	@if [ "$$(compose/kpx-compose --engine)" = podman ]; then compose/kpx-compose --release; fi

bench: $(STAMP)
	$(KPX) bench

bench-quick: $(STAMP)
	$(KPX) bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
