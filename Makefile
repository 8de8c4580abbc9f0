# The two commands of the README:
#   make train   the main job: prepare the default corpus, train the tiny model on 2 CPU processes
#                with ZeRO-2, export it and print a generated sample
#   make test    the test suite, both tiers (what CI runs); `make test-fast` the unit tier alone
# Each target sets itself up from nothing: a virtual environment in .venv, torch first (so the
# local CPU wheel, or the cluster's CUDA build, is used instead of pip choosing one), then lmsys.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
NPROC ?= 2
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: train test test-fast setup lint bench inspect clean

# INSTALLER=uv (default) resolves and installs lmsys's ~130 other packages with uv, in parallel:
# about 45 s against pip's 110 s on 2 cores (docs/performance.md). uv reads no pip.conf: where
# packages must come from a configured index, `make setup INSTALLER=pip` (or UV_INDEX_URL).
# torch always goes through pip, which honours pip.conf (a local wheel, a cluster's CUDA index).
INSTALLER ?= uv
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
ifeq ($(INSTALLER),uv)
	$(PIP) install uv
	$(PY) -m uv pip install -q --python $(PY) --compile-bytecode -e ".[dev]"
else
	$(PIP) install -e ".[dev]"
endif
	touch $@

setup: $(VENV)/.installed

# A fresh run directory per `make train` (expanded once, so every line names the same one);
# `make train RUN=runs/main-...` resumes that run instead.
RUN ?= runs/main-$(shell date +%Y%m%d-%H%M%S)
RUN := $(RUN)
PROMPT ?= The module

# launch.torchrun is torchrun --standalone plus what an operator expects of Ctrl-C and SIGTERM: the
# ranks save their step and the launch ends with one line (exit 130 / 75), no agent traceback.
train: $(VENV)/.installed
	$(PY) -m lmsys.prepare
	LMSYS_RESUME_COMMAND='make train RUN=$(RUN)$(if $(ARGS), ARGS="$(ARGS)")' \
		$(PY) -m launch.torchrun --nproc $(NPROC) -- model=tiny deepspeed=zero2 trainer.run_dir=$(RUN) $(ARGS)
	$(PY) -m lmsys.export $(RUN)
	$(PY) -m lmsys.generate $(RUN)/export prompt="$(PROMPT)" max_new_tokens=60 temperature=0.8 top_k=40 seed=0

# The suite has two tiers (docs/DESIGN.md, "Testing without a GPU"): tests/unit, in-process and
# fast, for the edit loop (`make test-fast`), and tests/integration, the real launches, the commands
# end to end and the docs' commands. `make test` (CI) runs both in 3 pytest-xdist workers, each
# test module whole on one worker (pyproject.toml); it is bound by CPU on 2 cores
# (docs/performance.md). TEST_WORKERS=0 runs one process (a debugger, -x, one module's output in
# order).
TEST_WORKERS ?= 3
# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on our build machines) no process
# caches lmsys's bytecode, and each of the suite's ~400 Python processes would compile its
# modules again (about 0.2 CPU-s each); a stale .pyc is recompiled in memory as before.
test: $(VENV)/.installed
	$(PY) -m compileall -q lmsys kernels launch tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# The unit tier and the repository's own checks (tests/test_*.py): everything but tests/integration.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=10 --ignore=tests/integration $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The kernel table (on CPU through the Triton interpreter: the code path only), then the training
# loop against a plain PyTorch loop; every benchmark: `python -m tools.bench --help`.
bench: $(VENV)/.installed
	$(PY) -m tools.bench

# Every kernel compiled for sm_80 and sm_90 without a GPU (kernels/README.md): registers, spills,
# occupancy, SASS; fails on a listed config that spills or cannot launch. INSPECT_ARGS adds flags,
# e.g. INSPECT_ARGS="--json inspect.json --dump cubins", or "--candidates" to see which of a wider
# set of tilings pass.
inspect: $(VENV)/.installed
	$(PY) -m tools.inspect $(INSPECT_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
