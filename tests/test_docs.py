"""Every code sample in the docs runs, so the docs cannot rot.

Each page (``README.md`` and ``docs/**/*.md``) is run by one fresh Python process in a fresh
temporary working directory, which executes the page's samples in order:

- a fenced ``python`` block runs in that process, in one namespace shared by the page's blocks;
- after ``<!-- run: torchrun N -->`` a block is a program of its own, run as a real N-process
  gloo world (``python -m torch.distributed.run --standalone``); ``<!-- run: torchrun N twice -->``
  runs it twice in the same directory (a first run that saves, a second, fresh one that resumes);
  ``... slow`` at the end (``<!-- run: torchrun 4 twice slow -->``) runs that program in the slow
  tier only (``-m slow``), to keep the default run short (only for a program no later block
  needs: the two tiers run a page's other blocks without it, and it alone);
  after ``<!-- run: continues -->`` a block is appended to the torchrun program above it;
- after ``<!-- run: bash -->`` a shell block runs with ``bash -e`` (``stashpoint`` on the PATH);
- after ``<!-- not run: REASON -->`` a block is shown, not run, and the reason is required.

A shell block that calls the ``stashpoint`` command must be marked one way or the other. Pages
owned by others keep their markers in :data:`OUTSIDE_MARKERS` until they are moved into them.

A failure names the page, the block's line and kind, and shows that block's output; tracebacks
point at the lines of the Markdown file. ``python tests/test_docs.py PAGE.md`` runs one page.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE_TIMEOUT_S = 240
BANNER = "=== stashpoint docs: "
PYTHON_LANGS = frozenset({"python", "py", "python3"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
GUIDE_PAGES = (
    "quickstart", "training-loop", "distributed", "resume", "resharding", "guarantees", "format", "migration"
)
# Pages the guide links to that are written elsewhere; a link to one may dangle until it exists.
PLANNED_PAGES: frozenset[str] = frozenset()

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|not run)\s*:\s*(?P<spec>.*?)\s*-->\s*$")
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_CLI_LINE = re.compile(r"^\s*(?:\$\s*)?stashpoint(?:\s|$)", re.MULTILINE)


@dataclass(frozen=True)
class Outside:
    """For a block on a page owned by others: its marker (as the page would write it), or a
    setup run just before it that stands for the reader's own objects (``stands_for``)."""

    marker: str | None = None
    setup: str = ""
    stands_for: str = ""


_READER = """
import torch
import stashpoint
from torch.utils.data import DataLoader
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
class MyModel(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
model = MyModel()
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
def train_one_step():
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward(); optim.step(); optim.zero_grad()
    return loss.item()
"""

#: (page, how the block's first code line starts) -> what the block needs. The README's and
#: TRAINING.md's fragments run after a setup that defines the reader's model, data and training
#: step. An entry that matches no block any more fails the test.
OUTSIDE_MARKERS: dict[tuple[str, str], Outside] = {
    ("README.md", "bash scripts/demo.sh"): Outside(
        "<!-- not run: the demo and the suite; tests/test_demo.py runs it -->"
    ),
    ("README.md", 'with stashpoint.CheckpointManager("runs/exp1"'): Outside(
        setup=_READER + "state = {'model': model, 'optim': optim, 'step': 0}\ntotal = 3\n",
        stands_for="the reader's model, optimizer and training step",
    ),
    ("README.md", "import stashpoint"): Outside(
        setup="scheduler = torch.optim.lr_scheduler.StepLR(optim, 10)\nsampler = stashpoint.StatefulSampler(64)\n"
        "step = 7\n",
        stands_for="the reader's scheduler, sampler and step",
    ),
    ("README.md", "sampler = stashpoint.StatefulSampler(dataset"): Outside(
        setup="sched = scheduler\n", stands_for="the reader's scheduler"
    ),
    ("README.md", "stashpoint ls runs/exp1"): Outside(
        "<!-- not run: a synopsis with placeholder paths; docs/guide/quickstart.md runs ls, inspect, verify -->"
    ),
    ("docs/TRAINING.md", "import torch"): Outside(setup=_READER, stands_for="the reader's dataset and model class"),
    ("docs/TRAINING.md", 'with stashpoint.CheckpointManager("runs/exp-17"'): Outside(
        setup="total_steps, val_loss = 3, 0.5\n", stands_for="the reader's run length and validation loss"
    ),
    ("docs/DISTRIBUTED.md", "# torchrun --nproc-per-node 4 train.py"): Outside(
        "<!-- not run: a sketch on NCCL (needs GPUs); docs/guide/distributed.md runs this pattern on gloo -->"
    ),
}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with the marker comment above it."""

    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None
    setup: Outside | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")


@dataclass(frozen=True)
class Step:
    """What the page runner does once: a python block, a torchrun program, or a shell block."""

    kind: str  # "python", "torchrun" or "bash"
    blocks: tuple[Block, ...]
    nproc: int = 1
    runs: int = 1  # a torchrun program run twice: first saves, then a fresh run resumes
    slow: bool = False  # a torchrun program run by the slow tier only

    @property
    def label(self) -> str:
        kind = f"torchrun {self.nproc}" + (" twice" if self.runs == 2 else "") if self.kind == "torchrun" else self.kind
        return f"{self.blocks[0].page} block at line {', '.join(str(b.line) for b in self.blocks)} ({kind})"


@dataclass
class Plan:
    """A page's steps in order, and every problem with its markers."""

    page: str
    steps: list[Step] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# reading and planning pages


def doc_pages(root: Path = ROOT) -> list[str]:
    """README.md and every Markdown file under docs/, relative to ``root``."""
    pages = [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]
    return [p.relative_to(root).as_posix() for p in pages]


def parse_blocks(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown text, and the markers that no code block follows."""
    blocks: list[Block] = []
    problems: list[str] = []
    lines = text.splitlines()
    pending: tuple[int, str] | None = None  # (line, marker) waiting for its block

    def orphan() -> None:
        if pending is not None:
            problems.append(f"{page}:{pending[0]}: marker {pending[1]!r} is not followed by a code block")

    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            if _MARKER.match(lines[i]) or lines[i].strip():
                orphan()
                pending = (i + 1, lines[i].strip()) if _MARKER.match(lines[i]) else None
            i += 1
            continue
        close, indent = fence.group("fence"), fence.group("indent")
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(close) and not lines[j].strip().strip(close[0])):
            j += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]]
        marker = pending[1] if pending else None
        blocks.append(Block(page, i + 1, fence.group("lang").lower(), "\n".join(body) + "\n", marker))
        pending, i = None, j + 1
    orphan()
    return blocks, problems


def apply_outside_markers(
    blocks: list[Block], page: str, outside: dict[tuple[str, str], Outside]
) -> tuple[list[Block], list[str]]:
    """Give the blocks of a page owned by others what ``outside`` keeps for them."""
    problems: list[str] = []
    used = set()
    out = []
    for b in blocks:
        key = next((k for k in outside if k[0] == page and b.first_line.startswith(k[1])), None)
        if key is not None:
            used.add(key)
            if b.marker is not None:
                problems.append(f"{b.where}: the page has its own marker now; remove its OUTSIDE_MARKERS entry")
            else:
                b = Block(b.page, b.line, b.lang, b.code, outside[key].marker, outside[key])
        out.append(b)
    problems += [
        f"{page}: OUTSIDE_MARKERS in tests/test_docs.py has an entry for a block starting with {k[1]!r} that the "
        "page no longer has; update or remove it"
        for k in outside
        if k[0] == page and k not in used
    ]
    return out, problems


def plan_page(blocks: list[Block], page: str) -> Plan:
    """Turn a page's blocks into the steps that run them; collect every marker problem."""
    plan = Plan(page)
    for b in blocks:
        m = _MARKER.match(b.marker) if b.marker else None
        kind, spec = (m.group("kind"), m.group("spec")) if m else ("", "")
        torchrun = re.fullmatch(r"torchrun\s+([1-9]\d*)(\s+twice)?(\s+slow)?", spec)
        if b.lang not in PYTHON_LANGS | SHELL_LANGS:
            if m:
                plan.problems.append(f"{b.where}: marker {b.marker!r} is on a {b.lang or 'plain'} block: never run")
        elif kind == "not run":
            if len(spec) < 10:
                plan.problems.append(f"{b.where}: '<!-- not run: REASON -->' needs a reason a reader understands")
        elif b.lang in SHELL_LANGS:
            if spec == "bash":
                plan.steps.append(Step("bash", (b,)))
            elif m:
                plan.problems.append(f"{b.where}: a shell block takes '<!-- run: bash -->' or '<!-- not run: ... -->'")
            elif _CLI_LINE.search(b.code):
                plan.problems.append(
                    f"{b.where}: this shell block calls the stashpoint command but is neither run nor marked: put "
                    "'<!-- run: bash -->' or '<!-- not run: REASON -->' on the line above it"
                )
        elif not m:
            plan.steps.append(Step("python", (b,)))
        elif torchrun:
            runs = 2 if torchrun.group(2) else 1
            plan.steps.append(Step("torchrun", (b,), int(torchrun.group(1)), runs, bool(torchrun.group(3))))
        elif spec == "continues" and plan.steps and plan.steps[-1].kind == "torchrun":
            last = plan.steps.pop()
            plan.steps.append(Step("torchrun", (*last.blocks, b), last.nproc, last.runs, last.slow))
        elif spec == "continues":
            plan.problems.append(
                f"{b.where}: 'continues' appends to a torchrun program, but the block before it is not one "
                "(python blocks of a page already share one process)"
            )
        else:
            plan.problems.append(
                f"{b.where}: unknown marker {b.marker!r}; use '<!-- run: torchrun N [twice] [slow] -->', "
                "'<!-- run: continues -->', '<!-- run: bash -->' or '<!-- not run: REASON -->'"
            )
    return plan


def load_plan(page: str, root: Path = ROOT, outside: dict[tuple[str, str], Outside] | None = None) -> Plan:
    """Read, mark and plan one page."""
    blocks, problems = parse_blocks((root / page).read_text(encoding="utf-8"), page)
    blocks, more = apply_outside_markers(blocks, page, OUTSIDE_MARKERS if outside is None else outside)
    plan = plan_page(blocks, page)
    plan.problems[:0] = problems + more
    return plan


# ---------------------------------------------------------------------------------------------
# running a page: a fresh process executes the steps in order (``test_docs.py --plan ...``)


def _source(blocks: tuple[Block, ...]) -> str:
    """The blocks' code at their own line numbers, so tracebacks point into the Markdown file."""
    out: list[str] = []
    for b in blocks:
        out.extend([""] * (b.line - len(out)))  # the code starts on the line after the fence
        out.extend(b.code.splitlines())
    return "\n".join(out) + "\n"


def _plan_json(plan: Plan, root: Path) -> str:
    steps = [
        {
            "label": s.label,
            "kind": s.kind,
            "nproc": s.nproc,
            "runs": s.runs,
            "file": str(root / plan.page),
            "source": s.blocks[0].code if s.kind == "bash" else _source(s.blocks),
            "setups": [[b.setup.setup, b.setup.stands_for] for b in s.blocks if b.setup and b.setup.setup],
        }
        for s in plan.steps
    ]
    return json.dumps({"page": plan.page, "steps": steps})


#: Appended to a torchrun program: once the sample's code has run to its end, each rank leaves
#: without interpreter finalization. Gloo's C++ worker threads can still hold Python objects then
#: and intermittently abort the process at teardown ("terminate called without an active
#: exception"): the torch issue pytorch/pytorch PR 179291 describes. It hit migration.md's
#: DCP-then-stashpoint program in about one run in five, after every line of it had run.
#: A sample that raises never reaches this line and fails as it should.
TORCHRUN_EXIT = "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"


def _run_steps(plan_file: Path, progress: Path, programs: Path) -> int:
    """The page runner: execute the steps in this process; the exit code."""
    doc = json.loads(plan_file.read_text())
    namespace: dict[str, object] = {"__name__": "__main__"}
    for n, step in enumerate(doc["steps"]):
        progress.write_text(str(n))
        print(f"\n{BANNER}{step['label']}", flush=True)
        try:
            if step["kind"] == "python":
                for code, stands_for in step["setups"]:
                    exec(compile(code, f"<setup in tests/test_docs.py: {stands_for}>", "exec"), namespace)
                exec(compile(step["source"], step["file"], "exec"), namespace)
                continue
            if step["kind"] == "torchrun":
                script = programs / f"step{n}.py"
                script.write_text(step["source"] + TORCHRUN_EXIT)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
                for run in range(step["runs"]):
                    if step["runs"] > 1:
                        print(f"--- run {run + 1} of {step['runs']}", flush=True)
                    rc = subprocess.run([*cmd, str(step["nproc"]), str(script)], check=False).returncode
                    if rc != 0:
                        break
            else:
                rc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["source"]], check=False).returncode
            if rc != 0:
                print(f"the {step['kind']} step exited with code {rc}", flush=True)
                return 1
        except BaseException as e:
            sys.stdout.flush()
            tb = e.__traceback__.tb_next if e.__traceback__ else None  # from the sample's frame on
            traceback.print_exception(type(e), e, tb)
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    progress.write_text("done")
    return 0


@dataclass(frozen=True)
class PageRun:
    """The outcome of running a page: ``failure`` is None when every step passed."""

    failure: str | None
    log: str


def run_page(plan: Plan, workdir: Path, root: Path = ROOT, timeout: float = PAGE_TIMEOUT_S) -> PageRun:
    """Run ``plan`` in a fresh process with ``workdir`` (created here) as its working directory."""
    scratch = workdir.parent / f"{workdir.name}-runner"
    (scratch / "programs").mkdir(parents=True)
    workdir.mkdir(parents=True)
    plan_file, progress, log_file = scratch / "plan.json", scratch / "progress", scratch / "log.txt"
    plan_file.write_text(_plan_json(plan, root))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--plan", str(plan_file), str(progress)]
    with open(log_file, "w") as log:
        proc = subprocess.Popen(
            [*cmd, str(scratch / "programs")], cwd=workdir, env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun then stops its workers (in sessions of their own)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    text = log_file.read_text(errors="replace")
    at = progress.read_text() if progress.exists() else ""
    if code == 0 and at == "done":
        return PageRun(None, text)
    step = plan.steps[int(at)] if at.isdigit() else None
    what = step.label if step else f"{plan.page} (before its first block)"
    why = f"hung for {timeout:.0f} s" if code is None else f"failed (exit code {code})"
    output = text[max(text.rfind(f"{BANNER}{step.label}"), 0) :] if step else text
    if len(output) > 12_000:
        output = "...\n" + output[-12_000:]
    return PageRun(f"{what} {why}; its output:\n{output}", text)


# ---------------------------------------------------------------------------------------------
# the tests


def test_every_sample_is_run_or_marked_with_a_reason() -> None:
    problems = [p for page in doc_pages() for p in load_plan(page).problems]
    assert not problems, "docs code blocks with marker problems:\n" + "\n".join(problems)


#: Pages whose samples use s3:// URLs: they run against the tests' own S3 server (SeaweedFS),
#: with its AWS_* variables in the environment and these buckets created fresh.
S3_PAGES = {"docs/guide/object-storage.md": ("my-bucket",)}
#: Pages about a framework that this Python cannot install (torchtitan 0.3 needs 3.11): skipped there.
NEEDS_PYTHON = {"docs/guide/torchtitan.md": (3, 11)}


def _steps(page: str, slow: bool) -> Plan:
    """The page's plan with only its slow-tier torchrun programs, or only the others."""
    plan = load_plan(page)
    return Plan(plan.page, [s for s in plan.steps if s.slow == slow], plan.problems)


def _run_samples(page: str, slow: bool, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if sys.version_info < NEEDS_PYTHON.get(page, (3,)):
        pytest.skip(f"{page} is about a framework that needs Python {NEEDS_PYTHON[page]} or later")
    if page in S3_PAGES:
        server = request.getfixturevalue("s3_env")
        for bucket in S3_PAGES[page]:
            server.create_bucket(bucket)
    res = run_page(_steps(page, slow), tmp_path / "work")
    if res.failure:
        pytest.fail(res.failure, pytrace=False)


@pytest.mark.parametrize("page", [p for p in doc_pages() if _steps(p, False).steps])
def test_page_samples_run(page: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _run_samples(page, False, tmp_path, request)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in doc_pages() if _steps(p, True).steps])
def test_slow_page_samples_run(page: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The torchrun programs marked ``slow`` (each a program of its own)."""
    _run_samples(page, True, tmp_path, request)


def test_the_guide_index_lists_every_page_and_the_guide_runs_every_kind_of_sample() -> None:
    pages = [p for p in doc_pages() if p.startswith("docs/guide/")]
    assert not [n for n in GUIDE_PAGES if f"docs/guide/{n}.md" not in pages], pages
    index = (ROOT / "docs/guide/index.md").read_text(encoding="utf-8")
    listed = {f"docs/guide/{m.group('target')}" for m in _LINK.finditer(index)}
    unlisted = sorted(set(pages) - listed - {"docs/guide/index.md"})
    assert not unlisted, f"docs/guide/index.md does not list {unlisted} in the reading order"
    kinds = {s.kind for page in pages for s in load_plan(page).steps}
    assert kinds == {"python", "torchrun", "bash"}, kinds


def test_relative_links_point_at_files_that_exist() -> None:
    broken = []
    for page in doc_pages():
        text = re.sub(r"```.*?```", "", (ROOT / page).read_text(encoding="utf-8"), flags=re.DOTALL)
        for m in _LINK.finditer(text):
            target = m.group("target").split("#", 1)[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue
            path = ((ROOT / page).parent / target).resolve()
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if not path.exists() and rel not in PLANNED_PAGES:
                broken.append(f"{page}: link to {m.group('target')} ({rel} does not exist)")
    assert not broken, "\n".join(broken)


def test_docs_name_only_the_public_api() -> None:
    """Users are told about ``stashpoint.<name>`` from ``__all__`` only: no private module
    (docs/ARCHITECTURE.md, which describes the layers for contributors, excepted)."""
    import stashpoint

    private = re.compile(r"stashpoint\._[a-z_]+")
    found = []
    for page in doc_pages():
        if page == "docs/ARCHITECTURE.md":
            continue
        for lineno, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{page}:{lineno}: {m.group(0)}" for m in private.finditer(line)]
    assert not found, "docs name private modules:\n" + "\n".join(found)
    for name in stashpoint.__all__:
        assert hasattr(stashpoint, name), name


def test_every_test_the_docs_cite_exists() -> None:
    """``test_x.py::test_name`` in a page names a test that is there (a trailing ``*`` or a
    prefix names several); ``test_x.py`` alone names a file that is there."""
    missing = []
    for page in doc_pages():
        text = (ROOT / page).read_text(encoding="utf-8")
        for m in re.finditer(r"`(test_[a-z0-9_]+\.py)(?:::(?:\*::)?([A-Za-z0-9_]+)\*?)?`", text):
            path = ROOT / "tests" / m.group(1)
            if not path.is_file():
                missing.append(f"{page}: {m.group(0)} (no such file)")
            elif m.group(2) and not re.search(rf"def {m.group(2)}", path.read_text(encoding="utf-8")):
                missing.append(f"{page}: {m.group(0)} (no such test)")
    assert not missing, "\n".join(missing)


# The harness itself, on pages written here (no torch: these take a second).


def _fake_page(tmp_path: Path, text: str) -> Plan:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "page.md").write_text(text)
    return load_plan("docs/page.md", root=tmp_path, outside={})


def test_harness_shares_names_across_blocks_and_names_the_failing_block(tmp_path: Path) -> None:
    plan = _fake_page(
        tmp_path,
        "# A page\n\n```python\nx = 41\nprint('first block ran')\n```\n\ntext\n\n"
        "```python\ny = x + 1\nprint('second sees', y)\nraise ValueError('broken sample')\n```\n",
    )
    assert not plan.problems and [s.kind for s in plan.steps] == ["python", "python"]
    res = run_page(plan, tmp_path / "work", root=tmp_path, timeout=60)
    assert res.failure is not None
    assert res.failure.startswith("docs/page.md block at line 10 (python) failed"), res.failure
    assert "second sees 42" in res.failure and "ValueError: broken sample" in res.failure
    assert "first block ran" not in res.failure  # the output shown is the failing block's
    assert 'page.md", line 13' in res.failure  # the traceback points at the Markdown line
    assert "first block ran" in res.log


def test_harness_runs_marked_shell_blocks_in_the_pages_directory(tmp_path: Path) -> None:
    plan = _fake_page(
        tmp_path,
        "```python\nopen('made-by-python.txt', 'w').write('hello')\n```\n\n<!-- run: bash -->\n"
        "```bash\ngrep -q hello made-by-python.txt\necho shell-ok\n```\n\n<!-- run: bash -->\n```bash\nfalse\n```\n",
    )
    res = run_page(plan, tmp_path / "work", root=tmp_path, timeout=60)
    assert "shell-ok" in res.log
    assert res.failure is not None and res.failure.startswith("docs/page.md block at line 12 (bash) failed")


def test_harness_reports_a_hung_block_and_stops_it(tmp_path: Path) -> None:
    plan = _fake_page(tmp_path, "```python\nprint('before')\n```\n\n```python\nimport time\ntime.sleep(600)\n```\n")
    res = run_page(plan, tmp_path / "work", root=tmp_path, timeout=2)
    assert res.failure is not None and res.failure.startswith("docs/page.md block at line 5 (python) hung for 2 s")


def test_harness_rejects_unmarked_cli_blocks_bad_markers_and_missing_reasons(tmp_path: Path) -> None:
    plan = _fake_page(
        tmp_path,
        "```bash\nstashpoint ls runs\n```\n\n<!-- not run: -->\n```python\npass\n```\n\n"
        "<!-- run: sometimes -->\n```python\npass\n```\n\n<!-- run: continues -->\n```python\npass\n```\n\n"
        "<!-- run: torchrun 2 -->\n\nsome prose\n\n```python\npass\n```\n",
    )
    text = "\n".join(plan.problems)
    assert "docs/page.md:1: this shell block calls the stashpoint command" in text
    assert "docs/page.md:6: '<!-- not run: REASON -->' needs a reason" in text
    assert "docs/page.md:11: unknown marker" in text
    assert "docs/page.md:16: 'continues' appends to a torchrun program" in text
    assert "docs/page.md:20: marker '<!-- run: torchrun 2 -->' is not followed by a code block" in text
    assert len(plan.problems) == 5, text
    assert [s.kind for s in plan.steps] == ["python"]  # only the last block: unmarked once its marker is orphaned


def test_harness_flags_stale_outside_markers(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("```python\nprint('changed')\n```\n")
    outside = {("README.md", "print('original')"): Outside("<!-- not run: a reason long enough -->")}
    plan = load_plan("README.md", root=tmp_path, outside=outside)
    assert any("no longer has" in p for p in plan.problems), plan.problems
    assert [s.kind for s in plan.steps] == ["python"]  # the changed block is run, as any unmarked one


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--plan"]:
        return _run_steps(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    if len(argv) != 1:
        print("usage: python tests/test_docs.py PAGE.md   (a path relative to the repository root)")
        return 2
    plan = load_plan(argv[0])
    for p in plan.problems:
        print("problem:", p)
    work = Path(tempfile.mkdtemp(prefix="stashpoint-docs-")) / "work"
    print(f"running {len(plan.steps)} step(s) of {argv[0]} in {work}")
    res = run_page(plan, work)
    print(res.log if res.failure is None else res.failure)
    if res.failure is None:
        shutil.rmtree(work.parent)
    return 0 if res.failure is None and not plan.problems else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
