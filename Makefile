# The two commands of the README's quick start, each from a fresh clone with nothing installed:
#   make serve    set up, build and serve the course site on http://127.0.0.1:8000
#   make test     set up and run the test suite (what .ci/run runs)
# Setup is a virtual environment in .venv, rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup serve test

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PYTHON) $(VENV)
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/course serve

test: $(STAMP)
	$(VENV)/bin/course test
