# The README's two commands: `make demo` and `make test`. Both build their own
# virtualenv in .venv from pyproject.toml, so a fresh clone needs only python3.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck packaging docs system-deps screenshots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.1"

# `--group` (PEP 735 dependency groups) needs pip 25.1 or later.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e . --group dev
	touch $@

demo: $(STAMP)
	$(BIN)/python testproject/manage.py migrate --noinput --verbosity 0
	$(BIN)/python testproject/manage.py dlock_demo

system-deps:
	scripts/system-deps.sh

test: system-deps $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The admin screenshots in docs/img/, taken by the browser test.
screenshots: system-deps $(STAMP)
	DLOCK_SCREENSHOT_DIR=docs/img $(BIN)/python -m pytest -q tests/test_admin_browser.py

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The documentation site, with warnings as errors.
docs: $(STAMP)
	rm -rf docs/_build
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html
	$(BIN)/sphinx-build -W --keep-going -b doctest docs docs/_build/doctest

packaging: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf $(VENV) dist build *.egg-info .pytest_cache .mypy_cache .ruff_cache .tox
