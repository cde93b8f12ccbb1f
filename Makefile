# qsync-opt: `make test` and `make demo` work from a fresh clone, with no GPU.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch pinned for this machine; an unpinned torch would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0
# The tests run on one pytest-xdist worker per core (at most 4: each holds about 2 GB), one
# unit per test file, heaviest first (tests/support/schedule.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: setup test test-fast demo lint typecheck bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=70.1"  # tests build a wheel without isolation
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/ruff check qsync_opt solvers models cuda tests benchmarks
	$(MAKE) typecheck
	$(BIN)/python -m pytest $(PARALLEL)

# The fast tier, for the inner loop: every test not marked slow (every folder of tests/ keeps
# some: tests/test_suite_tiers.py); `make test` (CI) runs them all.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PARALLEL)

demo: setup
	$(BIN)/qsync-opt demo

# mypy cannot follow package-dir, so it checks a tree of links laid out as the installed package;
# its cache lives beside that tree (build/mypy-cache), so a second run checks only what changed
typecheck: setup
	rm -rf build/typecheck && mkdir -p build/typecheck/qsync_opt
	for f in qsync_opt/*; do ln -s "$$PWD/$$f" build/typecheck/qsync_opt/; done
	ln -s "$$PWD/solvers" build/typecheck/qsync_opt/solvers
	ln -s "$$PWD/models" build/typecheck/qsync_opt/models
	ln -s "$$PWD/cuda" build/typecheck/qsync_opt/cuda
	cd build/typecheck && MYPYPATH=. ../../$(BIN)/mypy --config-file ../../pyproject.toml \
		--cache-dir ../mypy-cache -p qsync_opt

lint: setup
	$(BIN)/ruff check qsync_opt solvers models cuda tests benchmarks

bench: setup
	$(BIN)/python benchmarks/bench_trace.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
