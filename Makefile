# megatron_lite: `make train` and `make test` work on a fresh machine (they install what is missing).
# The virtual environment lives in .venv/. It sees system site-packages so that an already-installed torch
# (e.g. a cluster's CUDA build) is kept; if there is none, the lock's torch is installed (torch==2.13.0: the CPU
# build on this machine, where it lies on disk). Every other package comes at the version requirements.lock pins
# (README, Installing): a new upstream release enters only through `make lock`, a commit that passes the suite.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
PINS   := $(VENV)/constraints.txt
ARGS   ?=
# An offline machine installs from wheelhouse/ (built elsewhere by `make wheelhouse`) with no network at all.
WHEELHOUSE ?= wheelhouse
PYVER  ?= $(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
OFFLINE = $(if $(wildcard $(WHEELHOUSE)/*.whl),--no-index --find-links $(WHEELHOUSE),)

.PHONY: install lock lint system-deps ops test-ops data train test test-fast bench bench-gpu wheelhouse clean

install: $(STAMP)

# torch first (the machine's, else the lock's), then the lock's pins for that torch (tools/lock.py constraints:
# a machine's own torch keeps what it requires), then everything at those pins. Source distributions (DeepSpeed)
# build without isolation, with the locked setuptools, and the install ends by checking every version.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || { \
	  if [ -n "$(OFFLINE)" ]; then echo "no torch here and installing offline from $(WHEELHOUSE)/: install the machine's torch first"; exit 1; fi; \
	  $(PY) -m pip install -q "$$($(PY) tools/lock.py torch)"; }
	$(PY) -m pip install -q $(OFFLINE) -c $(LOCK) setuptools packaging
	$(PY) tools/lock.py constraints $(PINS)
	$(PY) -m pip install -q $(OFFLINE) --no-build-isolation -c $(PINS) -e ".[dev]"
	$(PY) tools/lock.py check $(PINS)
	touch $(STAMP)

# Re-resolve every package to today's newest release (torch stays at the lock's; TORCH=x.y.z to move it) and
# rewrite requirements.lock; `make install` then installs it. Commit the new lock only with a passing `make test`.
lock:
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) tools/lock.py write $(if $(TORCH),--torch $(TORCH))

# Every wheel beyond torch for an offline node: `make wheelhouse PYVER=3.12`, copy the folder next to the
# checkout there, then `make install` (or `make bench-gpu`) uses it without the network (docs/performance.md, "Performance").
wheelhouse: install
	$(PY) tools/wheelhouse.py --python-version $(PYVER) --out $(WHEELHOUSE) $(ARGS)

data: install data/shakespeare-8k/meta.json data/shakespeare-gpt2/meta.json

data/shakespeare-8k/meta.json:
	$(PY) tools/prepare_data.py --tokenizer assets/tokenizers/shakespeare-8k --out data/shakespeare-8k

data/shakespeare-gpt2/meta.json:
	$(PY) tools/prepare_data.py --tokenizer assets/tokenizers/gpt2 --out data/shakespeare-gpt2

train: data
	$(PY) train.py $(ARGS)

# System packages, installed when run as root with apt (otherwise what they enable is skipped, and said):
# libaio-dev lets DeepSpeed build its async I/O op, so NVMe offload is tested too; Slurm (slurmctld, slurmd,
# munge) runs a real two-node cluster on this machine for the tests of slurm/train.sbatch (tests/slurm).
APT_PACKAGES := libaio-dev slurmctld slurmd slurm-client munge

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1; } || \
	  echo "could not install $$missing: the NVMe offload and Slurm tests will be skipped where they need them"; \
	elif [ -n "$$missing" ]; then echo "not installed (needs root and apt): $$missing; their tests will be skipped"; fi

# DeepSpeed's CPU ops (shared-memory comm, CPU Adam, async I/O where libaio is installed), compiled once into
# torch's extension cache instead of by whichever run first needs them (about 10 minutes on 2 cores).
ops: install system-deps
	$(PY) tools/build_ops.py

# The tests build the two ops that tests need from the start; the test session builds the async I/O op (7 of
# the 10 minutes, needed by the NVMe test alone) on the cores' idle time while the other tests run, as it runs the
# offline install's steps (tests/conftest.py).
test-ops: install system-deps
	$(PY) tools/build_ops.py ShareMemCommBuilder CPUAdamBuilder

# ruff's linter and formatter (pyproject.toml, [tool.ruff]); `ruff format .` and `ruff check --fix .` repair most.
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# test: lint, then everything. test-fast: each feature once, by its cheapest case (it skips the cases marked
# `slow`, see pyproject.toml). Both print the 30 slowest tests.
test: lint data test-ops
	$(PY) -m pytest -q tests $(ARGS)

test-fast: lint data test-ops
	$(PY) -m pytest -q tests -m "not slow" $(ARGS)

bench: data
	$(PY) tools/bench_throughput.py $(ARGS)

# One command measures a GPU (within a 570 s budget, ARGS=--budget-s=N): tests/gpu and the kernels' CUDA cases, the kernel
# benchmark, bf16 throughput / MFU / memory against HF and a compiled baseline; results in bench/results/.
# Without CUDA it says so and exits 0.
bench-gpu: install
	$(PY) tools/bench_gpu.py $(ARGS)

clean:
	rm -rf runs outputs .pytest_cache
