"""Starting a Ray cluster of one machine for the application (`make serve`, the tests).

Ray runs a submitted job's entrypoint (`ray job submit -- python -m deployments job ...`) in a
shell whose `PATH` is the cluster's, that is the one of the process that started it. `make serve`
runs the virtual environment's interpreter without activating the environment, so a job's
`python` was the system's, which has no Ray ("No module named 'ray'"). Starting the cluster with
this interpreter's directory first on `PATH` makes a job's `python` the one serving.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray


def start_local_ray(**init_options):
    """`ray.init` of a new local cluster (its context) whose jobs' `python` is this process's interpreter."""
    interpreter_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != interpreter_dir:
        os.environ["PATH"] = os.pathsep.join([interpreter_dir, path]) if path else interpreter_dir
    return ray.init(address="local", **init_options)
