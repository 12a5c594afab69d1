"""The README stays short and true: every code block it shows is run here, or (when it needs root, other
hosts or minutes) every command in it is parsed by the CLI it names; a block quoting a file must match
that file; every link into results/ and docs/ lands."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 400
RUN_DIR = "/tmp/ns"
"""The run directory the README's examples use; the tests put a temporary one in its place."""

MARKER = re.compile(r"<!-- example: (?P<kind>run|parse|excerpt)(?P<rest>[^>]*)-->")


@dataclass
class Block:
    line: int
    kind: str
    rest: list[str]
    lang: str
    text: str


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README, with the marker on the line before it (kind None without one)."""
    lines = (README.read_text() if text is None else text).split("\n")
    out = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            out.append(Block(i + 1, marker["kind"] if marker else "", marker["rest"].split() if marker else [],
                             lang, "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return out


def commands(text: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    out = []
    for line in joined.split("\n"):
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            out.append(line)
    return out


def test_readme_is_at_most_400_lines() -> None:
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_every_code_block_says_how_it_is_checked() -> None:
    unmarked = [b.line for b in blocks() if not b.kind]
    assert not unmarked, f"README code blocks without an <!-- example: run|parse|excerpt --> marker: {unmarked}"


def test_the_block_reader_finds_markers_and_commands() -> None:
    text = "x\n<!-- example: run slow -->\n```sh\na \\\n  b  # note\n# c\nd &\n```\n```py\nq\n```\n"
    found = blocks(text)
    assert [(b.kind, b.rest, b.lang) for b in found] == [("run", ["slow"], "sh"), ("", [], "py")]
    assert commands(found[0].text) == ["a b", "d &"]


def _parse(argv: list[str]) -> None:
    from netstorm.cli import build_parser

    parser, _ = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"the README's `netstorm {shlex.join(argv)}` does not parse") from exc


def test_commands_of_blocks_that_need_hosts_or_root_parse() -> None:
    parsed = 0
    for block in blocks():
        if block.kind not in ("parse", "run"):
            continue
        for command in commands(block.text):
            argv = shlex.split(re.sub(r'"?\$\([^)]*\)"?', "127.0.0.1:7000", command.rstrip("&")))
            if argv[0] == "netstorm":
                _parse(argv[1:])
            elif argv[:2] == ["./run", "demo"]:
                _parse(["demo", *argv[2:]])
            elif argv[:2] == ["./run", "test"]:
                assert "./run test" in (ROOT / ".ci" / "run").read_text()   # CI runs exactly this
            else:
                continue
            parsed += 1
    assert parsed >= 10


def test_quoted_code_is_in_the_file_it_quotes() -> None:
    for block in blocks():
        if block.kind == "excerpt":
            source = (ROOT / block.rest[0]).read_text()
            assert block.text in source, f"README line {block.line}: not an excerpt of {block.rest[0]}"


def test_links_into_the_repository_land() -> None:
    from netstorm.emulation.markdown import results_readme

    text = README.read_text()
    generated = results_readme(ROOT / "results")
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", generated, re.M)}
    arch_anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / "ARCHITECTURE.md").read_text(),
                                                   re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README links to {path}, which does not exist"
        if anchor and path == "results/README.md":
            assert anchor in anchors, f"results/README.md has no section #{anchor}"
        if anchor and path == "docs/ARCHITECTURE.md":
            assert anchor in arch_anchors, f"docs/ARCHITECTURE.md has no section #{anchor}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


class Session:
    """Runs a block's commands in order as a shell would, with ``netstorm`` and ``python`` those of this
    checkout; a command ending in ``&`` runs in the background until the session ends, and the next
    command waits until it has printed READY (``netstorm local``'s signal that every node serves)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        bin_dir = run_dir.parent / "bin"
        bin_dir.mkdir(exist_ok=True)
        shim = bin_dir / "netstorm"
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m netstorm.cli "$@"\n')
        shim.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.background: list[subprocess.Popen[str]] = []

    def run(self, command: str, timeout: float) -> str:
        command = command.replace(RUN_DIR, str(self.run_dir))
        if command.endswith("&"):
            proc = subprocess.Popen(["bash", "-c", f"exec {command[:-1]}"], cwd=ROOT, env=self.env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            self.background.append(proc)
            ready = threading.Event()
            seen: list[str] = []

            def read() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    seen.append(line)
                    if line.startswith("READY"):
                        ready.set()

            threading.Thread(target=read, daemon=True).start()
            assert ready.wait(timeout), f"`{command}` printed no READY: {''.join(seen)[-2000:]}"
            return ""
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=self.env, text=True, capture_output=True,
                              timeout=timeout)
        assert done.returncode == 0, f"`{command}` exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        return done.stdout

    def close(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _run_blocks(tmp_path: Path, wanted: set[str]) -> list[str]:
    outputs = []
    for block in blocks():
        if block.kind != "run" or set(block.rest) != wanted:
            continue
        run_dir = tmp_path / f"ns{block.line}"
        session = Session(run_dir)
        try:
            outputs += [session.run(c, timeout=300) for c in commands(block.text)]
        finally:
            session.close()
    assert outputs, f"no README block marked run {' '.join(sorted(wanted))}"
    return outputs


@pytest.mark.slow
def test_the_readme_examples_run(tmp_path: Path) -> None:
    out = "\n".join(_run_blocks(tmp_path, set()))
    assert "every DC got the same average" in out
    assert "membership complete" in out and "netstorm" in out


@pytest.mark.slow
@pytest.mark.torch
def test_the_readme_pytorch_example_runs(tmp_path: Path) -> None:
    out = "\n".join(_run_blocks(tmp_path, {"slow", "torch"}))
    assert "MATCH: 3 ranks on netstorm" in out
