"""Every command in the README and the docs/ pages runs as written: their shell and Python
blocks, the README's first and then each page's (docs/*.md, by name), each in its page's order,
against one `make serve` started from this checkout, as a reader with a second terminal runs them.

A reader pastes one Python block, not every block above it: each runs in a fresh interpreter of
its own, or opens with one line naming the blocks of the same page it continues, by their
sections' titles, and the names it takes from them:

    # continues the block "Over HTTP" above: uses tree and torch

Such a block runs in the interpreter of the first block it continues (directly or through
another), in a copy of the namespace that block left: the other blocks it continues run again in
it, then the block. So it sees only the names of the blocks it names; what a block before it left
in that interpreter other than names (an object it changed) it shares, as a reader's session
would. The names a block reads and does not bind are checked against its first line without a
server too.

Each `bash` and `python` block is marked on the line before it: `<!-- readme-test: run -->`, or
`<!-- readme-test: skip: <why> -->` for one that cannot run here (a GPU, a cluster, a second
server on port 8000). A block without a mark fails the test, so a new one is not left out unseen.

Every relative link and image between the pages resolves, to a file and, after `#`, to a heading
of it; every path of this repository that a page names in backticks exists; every docs/ page is
reached from the README by links.

A reader has one Ray cluster, which `ray job submit` and `ray.init("auto")` find alone, and
whose dashboard agent has Ray's fixed port: `tests/conftest.py` runs this test first, before the
suite's own cluster starts.

The same `make serve` shows what its terminal prints: its ready line, then nothing about the
replicas' calls to each other (the workers' long polls of the weight coordinator once printed
`CALL next_commands OK 10014.7ms` every 10 s per worker), over at least 60 s of serving; and it
ends as a terminal's Ctrl-C ends it, with requests in flight.
"""

import builtins
import json
import os
import re
import shutil
import signal
import subprocess
import symtable
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.reliability import answers_when_stopped

REPOSITORY = Path(__file__).resolve().parents[1]
README = REPOSITORY / "README.md"
# The README first, then the docs pages by name: the order their blocks run in.
PAGES = [README, *sorted((REPOSITORY / "docs").glob("*.md"))]
VENV_PYTHON = REPOSITORY / ".venv/bin/python"
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\w*)\s*$")
MARK = re.compile(r"^\s*<!-- readme-test: (?:(?P<run>run)|skip: (?P<reason>.+)) -->\s*$")
HEADING = re.compile(r"^#{1,6} (?P<title>.+?)\s*$")
_NAMES = r"\w+(?:(?:, | and )\w+)*"
CONTINUES = re.compile(
    r'^# continues the blocks? (?P<sections>"[^"]+"(?:(?:, | and )"[^"]+")*) above: uses (?P<names>' + _NAMES + r")$"
)
START_TIMEOUT_S = 300.0  # a cold start took 40-100 s on the CI machine's 2 shared cores
BLOCK_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
SERVED_AT_LEAST_S = 60.0
# Long enough to be in flight at the Ctrl-C however idle the machine (16 samples of 40 steps each
# were once all done in time here, and the 503 went unchecked).
LONG_REQUEST = {
    "prompt": ["1", "2"],
    "num_outputs_per_prompt": 32,
    "num_inference_steps": 80,
    "rollout_debug_mode": False,
}
# The output path the README's job writes to; moved aside while the test runs if a reader's run left it.
JOB_OUTPUT = REPOSITORY / "outputs/rollouts"

# A fresh interpreter for one block that continues none: runs it, then each list of blocks it is
# sent (one JSON line each) in a copy of the namespace that first block left. After each line it
# prints one of its own: the last block's name and "ok", or the traceback and "failed".
SESSION = r"""
import json, sys, traceback
first = None
for line in sys.stdin:
    blocks = json.loads(line)
    namespace = {"__name__": "__main__"} if first is None else dict(first)
    try:
        for block in blocks:
            exec(compile(block["source"], block["name"], "exec"), namespace)
        outcome = "ok"
    except BaseException:
        traceback.print_exc()
        outcome = "failed"
    sys.stderr.flush()
    first = namespace if first is None else first
    print("\0" + json.dumps({"name": blocks[-1]["name"], "outcome": outcome}), flush=True)
"""


@dataclass
class Block:
    page: str  # its page's path in the repository
    line: int  # of its opening fence, 1-based
    language: str
    source: str
    skip_reason: str | None
    section: str = ""  # the title of the heading above it
    continues: list["Block"] = field(default_factory=list)  # the blocks its first line names
    uses: set[str] = field(default_factory=set)  # the names its first line says it takes from them

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def chain(self) -> list["Block"]:
        """The blocks a reader pastes, in the README's order, to run this one: those it continues,
        theirs, and itself."""
        found = {self.line: self}
        for continued in self.continues:
            found.update((block.line, block) for block in continued.chain())
        return [found[line] for line in sorted(found)]


def page_name(page: Path) -> str:
    return str(page.relative_to(REPOSITORY))


def all_blocks() -> list[Block]:
    """Every page's shell and Python blocks, in the order they run."""
    return [block for page in PAGES for block in page_blocks(page)]


def page_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    name = page_name(page)
    blocks, number, section = [], 0, ""
    while number < len(lines):
        fence = FENCE.match(lines[number])
        if not fence:
            heading = HEADING.match(lines[number])
            section = heading["title"] if heading else section
            number += 1
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
        if fence["language"] in ("bash", "python"):
            mark = MARK.match(lines[number - 1]) if number else None
            assert mark, (
                f"{name}:{number + 1}: a {fence['language']} block without a readme-test mark on the line before"
            )
            indent = len(fence["indent"])
            source = "\n".join(line[indent:] for line in lines[number + 1 : end]) + "\n"
            blocks.append(
                Block(name, number + 1, fence["language"], source, None if mark["run"] else mark["reason"], section)
            )
        number = end + 1
    for block in blocks:
        if block.language == "python":
            _read_continues_line(block, blocks)
    return blocks


def _read_continues_line(block: Block, blocks: list[Block]) -> None:
    first = block.source.splitlines()[0] if block.source.strip() else ""
    if not first.startswith("# continues"):
        return
    line = CONTINUES.match(first)
    assert line, f'{block.name}: not read as `# continues the block "<section>" above: uses a, b and c`: {first}'
    block.uses = set(re.split(r", | and ", line["names"]))
    for title in re.findall(r'"([^"]+)"', line["sections"]):
        sections = {b.section for b in blocks if b.section.startswith(title)}
        assert len(sections) == 1, f'{block.name}: "{title}" names {len(sections)} sections with blocks: {sections}'
        above = [
            b for b in blocks if b.section in sections and b.language == "python" and b.line < block.line
        ]
        assert len(above) == 1, f'{block.name}: "{title}" has {len(above)} Python blocks above it, not one'
        assert above[0].skip_reason is None, f"{block.name} continues {above[0].name}, which the test skips"
        block.continues.append(above[0])


def names_read_not_bound(source: str) -> set[str]:
    """The global names a block reads and binds nowhere at its top level, builtins aside."""
    module = symtable.symtable(source, "block", "exec")
    bound = names_bound(source)
    read, tables = set(), [module]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        read.update(
            symbol.get_name()
            for symbol in table.get_symbols()
            if symbol.is_referenced() and (table is module or symbol.is_global())
        )
    return read - bound - set(dir(builtins))


def names_bound(source: str) -> set[str]:
    module = symtable.symtable(source, "block", "exec")
    return {
        symbol.get_name()
        for symbol in module.get_symbols()
        if symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()
    }


def test_every_shell_and_python_block_is_marked_and_skips_say_why():
    blocks = all_blocks()
    # The README's three ways to call the server (HTTP, the handle, a job) run, and the pages' blocks.
    assert len([b for b in page_blocks(README) if b.skip_reason is None]) >= 3
    assert len([b for b in blocks if b.skip_reason is None]) >= 10
    assert all(len(b.skip_reason) > 20 for b in blocks if b.skip_reason is not None)


def test_each_python_block_reads_only_its_own_names_or_those_of_the_blocks_it_says_it_continues():
    """The names part of the rule, without a server: a block that reads `requests` or `handle` from a
    block above it says so on its first line, and its line lists exactly what it takes."""
    wrong = []
    for block in all_blocks():
        if block.language != "python":
            continue
        needed = names_read_not_bound(block.source)
        available = set().union(*(names_bound(b.source) for b in block.chain()[:-1]))
        if not needed <= available:
            wrong.append(
                f"{block.name} reads {sorted(needed - available)}, bound by no block it continues: import them,"
                f' or open it with `# continues the block "<section>" above: uses ...`'
            )
        elif block.uses != needed:
            wrong.append(f"{block.name}'s first line says it uses {sorted(block.uses)}; it reads {sorted(needed)}")
    assert not wrong, "\n".join(wrong)


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPOSITORY_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """A page's lines outside fenced blocks, with their 1-based numbers."""
    lines, inside, prose = page.read_text().splitlines(), False, []
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            prose.append((number, line))
    return prose


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, and -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(page):
        heading = HEADING.match(line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading["title"].lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(page: Path) -> list[tuple[int, str, Path, str]]:
    """Each relative link or image of a page: its line, its text, the file and the anchor it names."""
    found = []
    for number, line in prose_lines(page):
        for link in LINK.finditer(line):
            target = link["target"]
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            found.append((number, target, (page.parent / path).resolve() if path else page, anchor))
    return found


def test_links_between_the_pages_resolve_to_files_and_headings():
    wrong = []
    for page in PAGES:
        for number, target, file, anchor in links(page):
            where = f"{page_name(page)}:{number}: ({target})"
            if not file.exists() or not file.is_relative_to(REPOSITORY):
                wrong.append(f"{where}: no file {file}")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                wrong.append(f"{where}: no heading #{anchor} in {page_name(file)}")
    assert not wrong, "\n".join(wrong)


def test_every_docs_page_is_reached_from_the_readme():
    reached, todo = {README}, [README]
    while todo:
        for _, _, file, _ in links(todo.pop()):
            if file.suffix == ".md" and file.exists() and file not in reached:
                reached.add(file)
                todo.append(file)
    assert not set(PAGES) - reached, sorted(page_name(page) for page in set(PAGES) - reached)


def test_the_repository_paths_the_pages_name_exist():
    """A path in backticks whose first folder is one of this repository's (`rollout/kernels.py`,
    `tests/test_replay.py::test_...`, `deployments/app.py:build_app`) names a file or folder here."""
    folders = {path.name for path in REPOSITORY.iterdir() if path.is_dir() and not path.name.startswith(".venv")}
    folders -= {"outputs", ".git"}
    wrong = []
    for page in PAGES:
        for number, line in prose_lines(page):
            for span in CODE_SPAN.findall(line):
                for word in span.split():
                    path = re.sub(r"(::|:)[\w.]*$", "", word).rstrip(",;")
                    if "/" not in path or not REPOSITORY_PATH.match(path) or path.split("/")[0] not in folders:
                        continue
                    if not (REPOSITORY / path).exists():
                        wrong.append(f"{page_name(page)}:{number}: {path}")
    assert not wrong, "no such path here:\n" + "\n".join(wrong)


def reader_environment() -> dict:
    """A reader's shell: none of this test session's Ray settings, and the README's one export."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class Output:
    """A process's output, read on a thread as it comes."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._reader.start()

    def wait_for(self, predicate, process: subprocess.Popen, timeout_s: float, what: str) -> str:
        started = time.monotonic()
        while True:
            found = next((line for line in self.lines if predicate(line)), None)
            if found is not None:
                return found
            assert process.poll() is None, f"exited before {what}:\n{self.text()}"
            assert time.monotonic() - started < timeout_s, f"not {what} in {timeout_s} s:\n{self.text()}"
            time.sleep(0.2)

    def join(self, timeout_s: float) -> None:
        self._reader.join(timeout_s)

    def text(self, last: int = 200) -> str:
        return "".join(self.lines[-last:])


def stop(process: subprocess.Popen, signum: int) -> bool:
    """Sends `signum` to the process's group and waits for the whole group (its Ray cluster) to exit:
    whether it did within EXIT_TIMEOUT_S (else it is killed)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        process.poll()  # reaps the group's leader (make), which would stay in the group as a zombie
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=EXIT_TIMEOUT_S)
    return False


@pytest.fixture
def job_output_moved_aside(tmp_path):
    kept = tmp_path / "reader's outputs/rollouts"
    if JOB_OUTPUT.exists():
        kept.parent.mkdir()
        shutil.move(JOB_OUTPUT, kept)
    yield
    shutil.rmtree(JOB_OUTPUT, ignore_errors=True)
    if kept.exists():
        shutil.move(kept, JOB_OUTPUT)


def test_the_readme_and_the_docs_run_as_written_against_make_serve(job_output_moved_aside):
    assert VENV_PYTHON.exists(), "the README's commands use .venv: run the suite with `make test`"
    env = reader_environment()
    server = subprocess.Popen(
        ["make", "serve"],
        cwd=REPOSITORY,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own group: stopped, with its Ray cluster, as a terminal's Ctrl-C does
        # A shell running the suite in the background ignores SIGINT, and its children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    served = Output(server.stdout)
    sessions: dict[str, tuple[subprocess.Popen, Output]] = {}  # by the name of the block each began with
    try:
        ready = served.wait_for(lambda line: line.startswith("serving application"), server, START_TIMEOUT_S, "serving")
        ready_at = time.monotonic()
        assert "model embedded-digits (packaged weights)" in ready and "on http://127.0.0.1:8000" in ready, ready
        assert "(probes: http://127.0.0.1:8001)" in ready, ready
        assert re.search(r"Ray at 127\.0\.0\.1:\d+;", ready), ready
        for block in all_blocks():
            if block.skip_reason is not None:
                print(f"{block.name}: skipped: {block.skip_reason}")
                continue
            started = time.monotonic()
            if block.language == "bash":
                _run_shell_block(block, env)
            else:
                _run_python_block(block, sessions, env)
            print(f"{block.name}: ran in {time.monotonic() - started:.1f} s")

        time.sleep(max(0.0, SERVED_AT_LEAST_S - (time.monotonic() - ready_at)))
        # A terminal's Ctrl-C (SIGINT to the group) 3 s after three requests of several seconds.
        answers, exited = answers_when_stopped(
            lambda: stop(server, signal.SIGINT), [{**LONG_REQUEST, "seed": seed} for seed in range(3)]
        )
        served.join(EXIT_TIMEOUT_S)
    finally:
        for session, _ in sessions.values():
            session.kill()
            session.wait()
        if server.poll() is None:
            stop(server, signal.SIGKILL)

    # Ctrl-C answers every request in flight, with its samples if they were done in time, else with a
    # retryable 503, and stops the server and its Ray cluster.
    assert exited, served.text()
    statuses = [getattr(answer, "status_code", answer) for answer in answers]
    assert len(statuses) == 3 and set(statuses) <= {200, 503} and 503 in statuses, statuses
    assert all(answer.headers["retry-after"] == "1" for answer in answers if answer.status_code == 503)
    output = "".join(served.lines)
    print(f"make serve's terminal:\n{output}")
    # The ingress replica's own line, which is what `serve run deployments/serve_config.yaml` shows.
    ready_line = "rollout app 'rollout' up on http://127.0.0.1:8000/: model embedded-digits (packaged weights)"
    assert ready_line in output, output[-5000:]
    internal = [
        line for line in served.lines if " CALL " in line and ("WeightCoordinator" in line or "RolloutWorker" in line)
    ]
    assert not internal, "".join(internal[:20])
    assert "next_commands" not in output, output[-5000:]


def _run_shell_block(block: Block, env: dict) -> None:
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.source],
        check=False,
        cwd=REPOSITORY,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{block.name} exited {result.returncode}:\n{block.source}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )


def _run_python_block(block: Block, sessions: dict[str, tuple[subprocess.Popen, Output]], env: dict) -> None:
    """Runs a block that continues none in a fresh interpreter, and one that continues others in the
    interpreter of the first of them, after the others."""
    first, *rest = block.chain()
    if first is block:
        session = subprocess.Popen(
            [str(VENV_PYTHON), "-u", "-c", SESSION],
            cwd=REPOSITORY,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        sessions[block.name] = session, Output(session.stdout)
        rest = [block]
    session, output = sessions[first.name]
    session.stdin.write(json.dumps([{"name": b.name, "source": b.source} for b in rest]) + "\n")
    session.stdin.flush()
    done = output.wait_for(
        lambda line: line.startswith("\0") and f'"{block.name}"' in line,
        session,
        BLOCK_TIMEOUT_S * len(rest),
        f"done with {block.name}",
    )
    after = f" after {[b.name for b in [first, *rest[:-1]]]}" if first is not block else " in a fresh interpreter"
    assert json.loads(done[1:])["outcome"] == "ok", f"{block.name} failed{after}:\n{block.source}\n{output.text(60)}"
