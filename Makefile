# The README's commands: `make demo`, `make test` and `make serve`. Each sets up .venv first.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# Ray's switch for a cluster of one machine (the default on macOS and Windows): the node's IP is
# 127.0.0.1, so Ray's own servers listen on loopback. Every target here runs Ray on this machine only.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: setup demo test serve
setup:
	VENV=$(VENV) scripts/setup.sh

demo: setup
	$(PYTHON) examples/serve_demo.py --output outputs/demo

test: setup
	$(PYTHON) -m pytest

# make serve MODEL=/models/x: a local diffusers directory, its family read from its model_index.json.
# make serve ARGS="num_worker_replicas=1 model.dtype=bfloat16": the app config's fields, as `serve
# run` takes them; dotted keys set nested fields (make drops quotes, so a JSON value cannot pass).
MODEL ?=
serve: setup
	$(PYTHON) -m deployments serve $(if $(MODEL),--model "$(MODEL)") $(ARGS)
