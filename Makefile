# The two commands of the README's quick start, each from a fresh clone with nothing installed:
#   make serve    set up, build and serve the course site on http://127.0.0.1:8000
#   make test     set up and run the test suite (what .ci/run runs)
# Setup is a virtual environment in .venv, rebuilt when pyproject.toml changes.
# On a CUDA machine, in the environment that has the GPU stack (no set-up):
#   make gpu                          list the GPU check's parts
#   make gpu PART=tests-s05-s07 OUT=/tmp/gpu   run one part (python -m benchmarks.gpu_check)

PYTHON ?= python3
# the GPU machine's environment, as its set-up leaves it
GPU_PYTHON ?= python
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup serve test gpu

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PYTHON) $(VENV)
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/course serve

test: $(STAMP)
	$(VENV)/bin/course test

gpu:
ifdef PART
	$(GPU_PYTHON) -m benchmarks.gpu_check $(PART) $(or $(OUT),gpu_check_out)
else
	$(GPU_PYTHON) -m benchmarks.gpu_check --list
endif
