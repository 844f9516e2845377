"""The README and docs/ are checked against the code: the set-up commands CI runs, the links, every
`turnstile ...` command line against the real CLI, and the code blocks. No servers are needed."""

from __future__ import annotations

import ast
import enum
import functools
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main

from consumers.cli import app
from pipeline.inference.script import Script

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[torch]' && .venv/bin/turnstile demo"
)
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[dev]' "
    "&& .venv/bin/python -m pytest -q"
)
# A python block that cannot run on its own (it needs servers, a model, names from the text around it)
# says so on a line of its own; it is still compiled.
COMPILE_ONLY = "# docs: compile only"
MAX_README_LINES = 250


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    start: int | None = None
    lang = ""
    indent = ""
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if start is None:
            if stripped.startswith("```"):
                start, lang = number, stripped[3:].strip()
                indent = line[: len(line) - len(line.lstrip())]
        elif stripped == "```":
            body = [text.removeprefix(indent) for text in lines[start : number - 1]]
            found.append(Block(page, start, lang, "\n".join(body) + "\n"))
            start = None
    assert start is None, f"{page.relative_to(ROOT)}:{start}: a code block is never closed"
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


def test_readme_is_short_and_starts_with_the_two_set_up_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"
    bash = [block.text.strip() for block in blocks(README) if block.lang == "bash"]
    assert bash[:2] == [DEMO_COMMAND, TEST_COMMAND]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert TEST_COMMAND in [line.strip() for line in ci]


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = README.read_text(encoding="utf-8")
    missing = [page.name for page in PAGES[1:] if f"(docs/{page.name})" not in readme]
    assert not missing, f"README.md links no docs page for {missing}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links() -> Iterator[tuple[Path, int, str]]:
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue  # a URL
                yield page, number, f"{page.name}{target}" if target.startswith("#") else target


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def link_problem(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    linked = page.parent / path
    if not linked.exists():
        return "no such file"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"no heading #{anchor} in {path}"
    return None


def test_every_relative_link_resolves_to_a_file_and_heading() -> None:
    links = list(relative_links())
    assert len(links) > 10  # the pattern still finds the links
    broken = [
        f"{page.relative_to(ROOT)}:{number}: {target}: {problem}"
        for page, number, target in links
        if (problem := link_problem(page, target))
    ]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def shell_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def command_lines(block: Block) -> Iterator[tuple[int, str]]:
    """The shell command lines of a block with their line numbers in the page, continuation lines and quotes
    over several lines joined; in a text block, the lines after `$ `."""
    lines = block.text.splitlines()
    numbered = [(block.line + offset, line) for offset, line in enumerate(lines, 1)]
    if block.lang not in ("bash", "sh", "shell"):
        yield from ((number, line[2:]) for number, line in numbered if line.startswith("$ "))
        return
    pending, first = "", 0
    for number, line in numbered:
        pending, first = (f"{pending}\n{line}", first) if pending else (line, number)
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shell_words(pending)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        yield first, pending
        pending = ""
    assert not pending, f"{block.where()}: a quote is never closed in {pending!r}"


def turnstile_invocations(line: str) -> Iterator[list[str]]:
    """The argument lists of each `turnstile` command on a shell line (after `&&`, `|`, `;`, `&`, and the
    environment assignments before a command)."""
    command: list[str] = []
    for token in [*shell_words(line), ";"]:
        if token and set(token) <= set(";&|"):
            while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
                command.pop(0)
            if command and Path(command[0]).name == "turnstile":
                yield command[1:]
            command = []
        else:
            command.append(token)


@functools.cache
def cli() -> Any:
    """The click command tree typer makes of the `turnstile` app."""
    return typer.main.get_command(app)


def value_problem(kind: Any, value: str) -> str | None:
    """What is wrong with an option's value for its declared type (choices and numbers), or None."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        choices = [str(member.value) for member in kind]
        return None if value in choices else f"not one of {choices}"
    if kind in (int, float):
        try:
            kind(value)
        except ValueError:
            return f"not a number ({kind.__name__})"
    return None


def check_invocation(args: list[str]) -> str | None:
    """Why `turnstile ARGS` would not parse against the real CLI, or None: every subcommand exists, every
    option is one of that command's, an option that takes no value is given none, choices and numbers are
    valid, and no more arguments are given than the command takes. (typer carries a click of its own, so
    its objects are read by their attributes, not checked against the classes of the click package.)"""
    command: Any = cli()
    path = ["turnstile"]
    rest = list(args)
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        if sub is None:
            return f"`{' '.join(path)}` has no command {rest[0]!r}"
        path.append(rest.pop(0))
        command = sub
    if hasattr(command, "commands"):
        return f"`{' '.join(path)}` needs a command"
    params = command.params
    options = {name: param for param in params if param.param_type_name == "option"
               for name in (*param.opts, *param.secondary_opts)}  # fmt: skip
    positional: list[str] = []
    while rest:
        token = rest.pop(0)
        if token == "--":
            positional += rest
            break
        if not token.startswith("-") or token == "-":
            positional.append(token)
            continue
        name, has_value, value = token.partition("=")
        param = options.get(name)
        if param is None:
            return f"`{' '.join(path)}` has no option {name}"
        if param.is_flag or param.count:
            if has_value:
                return f"`{' '.join(path)} {name}` takes no value, given {value!r}"
            continue
        if not has_value:
            if not rest:
                return f"`{' '.join(path)} {name}` needs a value"
            value = rest.pop(0)
        if "$" not in value and (problem := value_problem(param.type_descriptor.annotation, value)):
            return f"`{' '.join(path)} {name} {value}`: {problem}"
    arguments = [param for param in params if param.param_type_name == "argument"]
    if all(param.nargs != -1 for param in arguments):
        most = sum(param.nargs for param in arguments)
        if len(positional) > most:
            return (
                f"`{' '.join(path)}` takes {most} argument(s), given {positional}"
                " (an option that takes no value given one?)"
            )
    return None


def documented_invocations() -> list[tuple[str, list[str]]]:
    return [
        (f"{block.page.relative_to(ROOT)}:{number}: {' '.join(line.split())}", args)
        for block in ALL_BLOCKS
        for number, line in command_lines(block)
        for args in turnstile_invocations(line)
    ]


def test_every_documented_turnstile_command_parses_against_the_cli() -> None:
    found = documented_invocations()
    assert len(found) > 20  # the extraction still finds the commands
    wrong = [f"{where}\n    {problem}" for where, args in found if (problem := check_invocation(args))]
    assert not wrong, "commands in the docs that the CLI refuses:\n" + "\n".join(wrong)


INLINE_COMMAND = re.compile(r"`(turnstile [^`]+)`")


def inline_commands() -> Iterator[tuple[str, str]]:
    """`turnstile ...` in inline code outside code blocks (the synopses in tables and text), by page:line."""
    for page in PAGES:
        fenced = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                for span in INLINE_COMMAND.findall(line):
                    yield f"{page.relative_to(ROOT)}:{number}", span


def synopsis_problem(span: str) -> str | None:
    """Why a synopsis such as `turnstile plot [NAME ...] [--policy P]` names what the CLI lacks: its
    commands must exist and every `--option` in it must be one of that command's."""
    command: Any = cli()
    path = ["turnstile"]
    for word in span.split()[1:]:
        if not hasattr(command, "commands") or not re.fullmatch(r"[a-z][a-z-]*", word):
            break
        if word not in command.commands:
            return f"`{' '.join(path)}` has no command {word!r}"
        path.append(word)
        command = command.commands[word]
    if hasattr(command, "commands"):
        return None  # a group named in passing (`turnstile serve ...`)
    names = {name for param in command.params for name in (*param.opts, *param.secondary_opts)}
    unknown = sorted(set(re.findall(r"--[a-z][a-z-]*", span)) - names - {"--help"})
    return f"`{' '.join(path)}` has no option {', '.join(unknown)}" if unknown else None


def test_every_turnstile_synopsis_in_the_text_names_real_commands_and_options() -> None:
    found = list(inline_commands())
    assert len(found) > 30  # the extraction still finds them
    wrong = [f"{where}: `{span}`: {problem}" for where, span in found if (problem := synopsis_problem(span))]
    assert not wrong, "synopses the CLI does not match:\n" + "\n".join(wrong)


def test_the_synopsis_check_finds_a_missing_option() -> None:
    assert synopsis_problem("turnstile plot [NAME ...] [--policy P] [--out DIR]") is None
    assert synopsis_problem("turnstile serve gateway --port 8000 [--max-open-sessions N]") is None
    assert "--plian" in (synopsis_problem("turnstile plot [--plian]") or "")
    assert "'servee'" in (synopsis_problem("turnstile servee gateway") or "")


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["replay", "abc", "--tokens", "--json"], None),
        (["plot", "reward_curve", "--policy", "demo", "--out", "x"], None),
        (["serve", "inference", "--policy", "main", "--backend", "torch"], None),
        (["replay", "abc", "--tokens", "true"], "takes 1 argument(s)"),
        (["replay", "abc", "--tokens=yes"], "takes no value"),
        (["ui", "--modle", "x"], "has no option --modle"),
        (["serve", "inference", "--backend", "tpu"], "--backend tpu"),
        (["serve", "nothing"], "has no command 'nothing'"),
        (["model"], "needs a command"),
        (["sql", "SELECT 1", "--limit", "many"], "--limit many"),
    ],
)
def test_the_command_check_refuses_what_the_cli_refuses(args: list[str], problem: str | None) -> None:
    found = check_invocation(args)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_shell_lines_are_split_into_turnstile_commands() -> None:
    line = "TURNSTILE_NATS_URL=nats://x turnstile serve relay --metrics-port 0 &  # comment --nope"
    assert list(turnstile_invocations(line)) == [["serve", "relay", "--metrics-port", "0"]]
    assert list(turnstile_invocations(DEMO_COMMAND)) == [["demo"]]
    assert list(turnstile_invocations('turnstile up & turnstile sql "$(cat q.sql)" | head')) == [
        ["up"],
        ["sql", "$(cat q.sql)"],
    ]


PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.lang == "python"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.where() for block in PYTHON_BLOCKS])
def test_python_blocks_compile_and_the_self_contained_ones_run(block: Block) -> None:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    compile(block.text, block.where(), "exec", flags=flags, dont_inherit=True)
    if COMPILE_ONLY in block.text.splitlines()[0]:
        return
    done = subprocess.run(
        [sys.executable, "-c", block.text], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{block.where()} failed:\n{done.stderr}"


def test_some_python_blocks_run() -> None:
    running = [block for block in PYTHON_BLOCKS if COMPILE_ONLY not in block.text.splitlines()[0]]
    assert running, "no python block in the docs runs: mark only those that cannot"


@pytest.mark.parametrize(
    "block",
    [block for block in ALL_BLOCKS if block.lang in ("json", "toml")],
    ids=lambda block: block.where(),
)
def test_json_and_toml_blocks_parse(block: Block) -> None:
    if block.lang == "toml":
        tomllib.loads(block.text)
        return
    document = json.loads(block.text)
    if isinstance(document, dict) and "rules" in document:  # a scripted policy: the consumer must take it
        Script.model_validate(document)
