"""Two commits against each other, round by round: is a change free of a speed regression?

    .venv/bin/python -m benchmarks.ab 8337695            # that commit against HEAD
    .venv/bin/python -m benchmarks.ab OLD NEW --rounds 8 --output docs/redesign_ab.md

Each commit is checked out into a temporary git worktree and served by a process of its own
(`--serve`: its own Ray cluster, the suite's one-replica application and default application, and
the library alone in a separate process), started from that worktree so that every process of it
imports that commit's code. The two servers stay up side by side and take turns, one round each,
in an order that alternates every round, so that drift on a shared machine hits both alike. A
round times, once each: the suite's served-against-in-process figures (64 samples, light and
heavy, through the in-process library, the handle and HTTP msgpack) and its burst figure (16
one-sample requests against one 16-sample request, default application). Reported: each
commit's own ratios (as `python -m benchmarks` reports them) and new / old speed per path, as
median (min - max) over the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The suite's own requests and application, as the commit being served defines them.
from benchmarks.__main__ import HEAVY, LIGHT, ONE_REPLICA, request
from benchmarks.serving import Spread

REPO = Path(__file__).resolve().parent.parent
WORK = {"light": LIGHT, "heavy": HEAVY}
PATHS = ("in-process", "handle", "HTTP msgpack")
BURST = ("one 16-sample request", "16 one-sample requests")


# A commit's server -------------------------------------------------------------------------------


def serve(port: int, only: str) -> None:
    """Serves rounds on stdin ("round" -> one JSON line of seconds per figure) until "quit"; only
    the figures whose names contain `only`."""
    import ray
    import requests
    from ray import serve as ray_serve

    from benchmarks.serving import InProcessSampler, post_msgpack
    from deployments.app import build_app

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
    one = ray_serve.run(build_app({**ONE_REPLICA, "app_name": "one"}), name="one", route_prefix="/one")
    default = ray_serve.run(build_app({"app_name": "default"}), name="default", route_prefix="/default")
    sampler = InProcessSampler(threads=1)
    session = requests.Session()
    url = f"http://127.0.0.1:{port}/one/rollout/generate"
    runs = {}
    for label, fields in WORK.items():
        body = request(64, **fields)
        runs[f"{label}: in-process"] = lambda body=body: sampler.run(body, ONE_REPLICA["max_batch_size"])
        runs[f"{label}: handle"] = lambda body=body: one.generate.remote(body).result().batch()
        runs[f"{label}: HTTP msgpack"] = lambda body=body: post_msgpack(session, url, body)
    runs[BURST[0]] = lambda: default.generate.remote({**LIGHT, "prompt": "3", "num_outputs_per_prompt": 16}).result().batch()
    runs[BURST[1]] = lambda: [
        r.result().batch() for r in [default.generate.remote({**LIGHT, "prompt": "3", "seed": i}) for i in range(16)]
    ]
    runs = {name: run for name, run in runs.items() if only in name}
    info = session.get(f"http://127.0.0.1:{port}/one/rollout/info").json()
    for run in runs.values():  # warm-up
        run()
    print(json.dumps({"ready": True, "model_path": info["model_path"]}), flush=True)
    try:
        for line in sys.stdin:
            if line.strip() != "round":
                break
            seconds = {}
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                seconds[name] = time.perf_counter() - start
            print(json.dumps(seconds), flush=True)
    finally:
        sampler.close()
        ray_serve.shutdown()
        ray.shutdown()


# The controller ----------------------------------------------------------------------------------


class Server:
    def __init__(self, commit: str, tree: Path, port: int, only: str):
        self.commit = commit
        # This file runs from the commit's tree on its path; the rest is the commit's own code.
        env = {**os.environ, "PYTHONPATH": str(tree), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", str(port), only],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        ready = json.loads(self._line())
        if not ready["model_path"].startswith(str(tree)):
            raise SystemExit(f"{commit}: served {ready['model_path']}, not from its worktree {tree}")

    def round(self) -> dict[str, float]:
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.flush()
        self.process.wait(timeout=120)

    def _line(self) -> str:
        while True:  # Ray and Serve may print their own lines first
            line = self.process.stdout.readline()
            if not line:
                raise SystemExit(f"{self.commit}: its server exited")
            if line.startswith("{"):
                return line


def report(commits: list[str], rounds: list[dict[str, dict[str, float]]], minutes: float, only: str) -> list[str]:
    old, new = commits
    command = f"python -m benchmarks.ab {old} {new} --rounds {len(rounds)}" + (f" --only {only!r}" if only else "")
    lines = [
        f"# `{old}` against `{new}`",
        "",
        f"`{command}`, {datetime.date.today()}, "
        f"{os.cpu_count()} cores, {minutes:.1f} min; each figure median (min - max) over the rounds.",
        "",
        "| figure | " + " | ".join(f"`{c}`" for c in commits) + " |",
        "|---|---|---|",
    ]
    measured = rounds[0][old]
    for label in WORK:
        for path in PATHS[1:]:
            if f"{label}: {path}" in measured and f"{label}: in-process" in measured:
                ratios = [[r[c][f"{label}: in-process"] / r[c][f"{label}: {path}"] for r in rounds] for c in commits]
                lines.append(f"| {label}: {path} / in-process | " + " | ".join(f"{Spread(tuple(x))}" for x in ratios) + " |")
    if all(name in measured for name in BURST):
        bursts = [[r[c][BURST[0]] / r[c][BURST[1]] for r in rounds] for c in commits]
        lines.append(f"| {BURST[1]} / {BURST[0]} | " + " | ".join(f"{Spread(tuple(x))}" for x in bursts) + " |")
    lines += ["", f"Speed of `{new}` over `{old}`, per path:", "", "| path | new / old |", "|---|---|"]
    for name in measured:
        lines.append(f"| {name} | {Spread(tuple(r[old][name] / r[new][name] for r in rounds))} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--only", default="", help="only the figures whose names contain this, e.g. 'requests'")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    commits = [args.old, args.new]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        trees = [Path(scratch) / f"tree-{i}" for i in range(2)]
        for commit, tree in zip(commits, trees):
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
        servers = []
        try:
            servers = [Server(commit, tree, 8130 + i, args.only) for i, (commit, tree) in enumerate(zip(commits, trees))]
            rounds = []
            for number in range(args.rounds):
                order = servers if number % 2 == 0 else servers[::-1]
                rounds.append({server.commit: server.round() for server in order})
                print(f"round {number + 1} of {args.rounds}", flush=True)
        finally:
            for server in servers:
                server.close()
            for tree in trees:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    lines = report(commits, rounds, (time.monotonic() - started) / 60, args.only)
    print("\n".join(lines))
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if "--serve" in sys.argv:
        at = sys.argv.index("--serve")
        serve(int(sys.argv[at + 1]), sys.argv[at + 2])
    else:
        main()
