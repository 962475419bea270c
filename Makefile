# The README's two commands: `make demo` and `make test`. Each builds its own
# virtualenv from pyproject.toml, so a fresh clone needs only python3 (3.10+).
#   - demo: .venv-demo holds the package and its celery extra, nothing else,
#     installed from wheels only: no compiler, no C headers, no apt, no root.
#   - everything else: .venv holds the dev group, which builds mysqlclient
#     from source, so it waits for scripts/system-deps.sh (headers from apt).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_VENV ?= .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_STAMP := $(DEMO_VENV)/.installed
DOCS_VENV ?= .venv-docs
DOCS_BIN := $(DOCS_VENV)/bin
DOCS_STAMP := $(DOCS_VENV)/.installed

.PHONY: demo fresh-check test realproject model-long chaos lint typecheck packaging release-check docs system-deps screenshots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.1"

# `--group` (PEP 735 dependency groups) needs pip 25.1 or later. The dev group
# compiles mysqlclient: the system packages come first.
$(STAMP): pyproject.toml | $(BIN)/python system-deps
	$(BIN)/python -m pip install --quiet -e . --group dev
	touch $@

$(DEMO_BIN)/python:
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/python -m pip install --quiet --only-binary :all: --upgrade pip

# `--only-binary :all:` makes a dependency that would need a build fail here,
# in our CI (make fresh-check), not on a user's machine.
$(DEMO_STAMP): pyproject.toml | $(DEMO_BIN)/python
	$(DEMO_BIN)/python -m pip install --quiet --only-binary :all: -e ".[celery]"
	touch $@

demo: $(DEMO_STAMP)
	$(DEMO_BIN)/python testproject/manage.py migrate --noinput --verbosity 0
	$(DEMO_BIN)/python testproject/manage.py dlock_demo

# `make demo` in a throwaway copy of the tree, as on a fresh machine: no pip
# cache, and pkg-config, mysql_config and pg_config answer "not found".
fresh-check:
	scripts/fresh-check.sh

system-deps:
	scripts/system-deps.sh

# The suite on PYTEST_WORKERS processes (pytest-xdist): most tests sleep while
# leases run out, so they overlap well even on 2 cores. Each worker starts its
# own servers (tests/settings.py); tests that share a costly module fixture
# stay on one worker (xdist groups, tests/conftest.py). PYTEST_WORKERS=0 runs
# them one after the other in this process.
PYTEST_WORKERS ?= 2
test: system-deps $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist load $(PYTEST_ARGS)

# The realistic project (tests/realproject/): its own `manage.py test` on
# PostgreSQL, then concurrent increments down every guarded path under uvicorn
# and a Celery worker on RabbitMQ, ATOMIC_REQUESTS on and off x the database and
# Redis lock backends; a table of lost updates, connections left open and 5xx.
realproject: system-deps $(STAMP)
	$(BIN)/python tests/realproject/load.py $(REALPROJECT_ARGS)

# The model-based tests (tests/test_model.py) with Hypothesis's "long" profile:
# examples without end, one backend after the other; narrow it with
# PYTEST_ARGS="-k redis" and stop it with Ctrl-C.
model-long: system-deps $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest tests/test_model.py $(PYTEST_ARGS)

# Every backend against every fault (chaos/run.py), with the workers holding a
# mutex, then a semaphore: about 20 minutes, then a table each; exit 1 on any
# violation. CI runs `make chaos CHAOS_ARGS=--short` (each fault and each
# backend once, per kind: about 4 minutes). The network faults need root
# (namespaces and iptables); without it they are skipped, saying so.
CHAOS_ARGS ?= --seconds 600
chaos: system-deps $(STAMP)
	$(BIN)/python -m chaos $(CHAOS_ARGS)
	$(BIN)/python -m chaos --kind semaphore $(CHAOS_ARGS)

# The admin screenshots in docs/img/, taken by the browser test.
screenshots: system-deps $(STAMP)
	DLOCK_SCREENSHOT_DIR=docs/img $(BIN)/python -m pytest -q tests/test_admin_browser.py

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

$(DOCS_BIN)/python:
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_BIN)/python -m pip install --quiet --upgrade "pip>=25.1"

# The docs group alone, not the package: conf.py puts the tree on sys.path.
$(DOCS_STAMP): pyproject.toml | $(DOCS_BIN)/python
	$(DOCS_BIN)/python -m pip install --quiet --group docs
	touch $@

# The documentation site, with warnings as errors. The html comes from
# .venv-docs, so every run proves the docs group is enough to build it. The
# doctests run in .venv: getting-started.md runs a @locked_task, which needs
# Celery (the docs group only mocks it, for autodoc).
docs: $(DOCS_STAMP) $(STAMP)
	rm -rf docs/_build
	$(DOCS_BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html
	$(BIN)/sphinx-build -W --keep-going -b doctest docs docs/_build/doctest

packaging: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

# The release as users get it (scripts/release_check.py): sdist and wheel,
# twine check --strict, the sdist's contents, then the wheel with every extra
# installed from wheels only into fresh virtualenvs on Python 3.10 + Django 4.2,
# 3.12 + 6.0, 3.13 + 5.2 and 3.12 + 6.1 (pyenv's), each running migrate, check, a lock, a
# locked Celery task and a locked task-framework task. CI runs it.
release-check: $(STAMP)
	$(BIN)/python scripts/release_check.py $(RELEASE_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(DOCS_VENV) dist build *.egg-info .pytest_cache .mypy_cache .ruff_cache .tox
