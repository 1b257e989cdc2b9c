# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup demo test
setup:
	VENV=$(VENV) scripts/setup.sh

demo: setup
	$(PYTHON) examples/serve_demo.py --output outputs/demo

test: setup
	$(PYTHON) -m pytest
