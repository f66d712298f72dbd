# Quickstart: `make demo` runs the main job on embedded defaults; `make test` runs the suite.
# Both create .venv and install what they need (torch pinned to the CPU wheel; redis-server when missing).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install redis test lint demo proto clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip check
	touch $(STAMP)

redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq redis-server)

lint: install
	$(VENV)/bin/ruff check .

test: install redis
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -x --timeout 900 -p no:cacheprovider

demo: install
	$(VENV)/bin/recsvc demo --out artifacts/demo

clean:
	rm -rf artifacts .pytest_cache .ruff_cache
