"""What the user-facing docs say that the code can check, without starting anything: the module tables of
docs/architecture.md and docs/lb.md, the flag tables of docs/operations.md and docs/lb.md with their defaults, and
the status of every error type the docs and the code name."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from handoff.protocol import errors as E

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# the docs a user follows (docs/reliability.md and docs/benchmarks.md are records of their time)
USER_DOCS = [ROOT / "README.md"] + [DOCS / f"{name}.md" for name in (
    "api", "architecture", "engines", "kubernetes", "lb", "memory", "operations", "rl-guide")]
ERROR_TYPES = {value.name: value.status for value in vars(E).values() if isinstance(value, E.ErrorType)}
UNITS = {"KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def section(doc: Path, heading: str) -> str:
    """The text under ``heading`` (a whole line) up to the next heading."""
    return ("\n" + doc.read_text()).split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def table_cells(text: str, first: str) -> Iterator[list[str]]:
    """The cells of every table row of ``text`` whose first cell starts with ``first``."""
    for row in text.splitlines():
        if row.startswith(f"| {first}"):
            yield [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def modules_of(package: str) -> set[str]:
    return {str(path.relative_to(ROOT / package)) for path in (ROOT / package).rglob("*.py")
            if path.name != "__init__.py"}


def listed_modules(cells: list[str], modules: set[str]) -> tuple[set[str], set[str]]:
    """The modules the first cells of a module table name (a folder names all of its own), and the names that are
    no module (a file that no longer exists)."""
    listed: set[str] = set()
    unknown: set[str] = set()
    for name in (name for cell in cells for name in re.findall(r"`([\w/.]+)`", cell)):
        inside = {m for m in modules if m == name or m.endswith("/" + name) or (name.endswith("/") and
                                                                               m.startswith(name))}
        (listed.update(inside) if inside else unknown.add(name))
    return listed, unknown


@pytest.mark.parametrize("package", ["node_engine", "node_sidecar", "handoff"])
def test_the_architecture_tables_name_every_module_and_no_other(package: str) -> None:
    """docs/architecture.md's table of ``package`` lists every module of the tree, and none that is gone."""
    cells = [row[0] for row in table_cells(section(DOCS / "architecture.md", f"## `{package}/`" + {
        "node_engine": ": the engine", "node_sidecar": ": the node's door",
        "handoff": ": the command, the client, shared plumbing"}[package]), "`")]
    modules = modules_of(package)
    listed, unknown = listed_modules(cells, modules)
    assert not unknown, f"docs/architecture.md names modules {package}/ does not have: {sorted(unknown)}"
    assert modules <= listed, f"docs/architecture.md leaves out {sorted(modules - listed)}"


def test_the_lb_module_map_names_every_module_and_no_other() -> None:
    cells = [row[0] for row in table_cells(section(DOCS / "lb.md", "## Module map"), "`lb/")]
    modules = {f"lb/{m}" for m in modules_of("lb")}
    listed, unknown = listed_modules(cells, modules)
    assert not unknown and modules <= listed, (sorted(unknown), sorted(modules - listed))


def parser_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {option: action.default for action in parser._actions for option in action.option_strings}


def documented_default(text: str) -> Any:
    """A default cell's value: a number (with its unit), a quoted literal, off/none/required; ``...`` when it is
    prose (``detected``, another flag's value)."""
    text = text.strip()
    literal = re.fullmatch(r"`([\w.:]+)`", text)
    if literal:
        text = literal.group(1)
    number = re.fullmatch(r"([\d.]+)(?: (s|KiB|MiB|GiB))?", text)
    if number:
        return float(number.group(1)) * UNITS.get(number.group(2) or "", 1)
    if text in ("off", "none", "required"):
        return None
    return text if literal else ...


def flag_tables() -> Iterator[tuple[str, argparse.ArgumentParser, list[str]]]:
    from lb.__main__ import build_parser as lb_parser
    from node_engine.__main__ import build_parser as engine_parser
    from node_sidecar.__main__ import build_parser as sidecar_parser

    for doc, heading, parser in (("operations.md", "### Engine flags", engine_parser()),
                                 ("operations.md", "### Sidecar flags", sidecar_parser()),
                                 ("lb.md", "## Flags", lb_parser())):
        for cells in table_cells(section(DOCS / doc, heading), "`--"):
            yield f"{doc} {heading}", parser, cells


def test_every_flag_of_the_flag_tables_exists_with_its_documented_default() -> None:
    """Each flag in the first cell exists; where the default cell gives one plain value per flag, it is the
    parser's (prose defaults, "the model's", are the engine's to resolve and are not checked here)."""
    problems = []
    checked = 0
    for where, parser, cells in flag_tables():
        defaults = parser_defaults(parser)
        flags = re.findall(r"`(--[a-z0-9-]+)", cells[0])
        problems += [f"{where}: {flag} is no flag" for flag in flags if flag not in defaults]
        values = re.split(r",\s*", cells[1]) if cells[1] else []
        if len(values) != len(flags):
            continue
        for flag, value in zip(flags, values):
            want, got = documented_default(value), defaults.get(flag)
            if want is ...:
                continue
            checked += 1
            same = (want == got or (want is None and got in (None, False))
                    or (isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool)
                        and float(got) == want))
            if not same:
                problems.append(f"{where}: {flag} documented {value!r}, the parser's default is {got!r}")
    assert checked > 40 and not problems, problems


def test_the_api_error_table_lists_every_type_with_its_status() -> None:
    """docs/api.md's table names every type of handoff/protocol/errors.py in the row of its status."""
    table = section(DOCS / "api.md", "# API")
    rows = {}
    for cells in table_cells(table, ""):
        status = re.match(r"(\d{3})", cells[0])
        for name in re.findall(r"`([a-z_]+)`", " ".join(cells)) if status else []:
            rows.setdefault(name, set()).add(int(status.group(1)))
    missing = [name for name in ERROR_TYPES if name not in rows]
    wrong = [(name, rows[name], status) for name, status in ERROR_TYPES.items() if status not in rows.get(name, ())]
    assert not missing and not wrong, (missing, wrong)


def test_every_status_the_docs_give_an_error_type_is_its_own() -> None:
    """``NNN `type``` anywhere in the user-facing docs is the status handoff/protocol/errors.py gives the type."""
    wrong = []
    for doc in USER_DOCS:
        text = doc.read_text()
        for match in re.finditer(r"\b([1-5]\d\d) `([a-z_]+)`", text):
            status, name = int(match.group(1)), match.group(2)
            if name in ERROR_TYPES and ERROR_TYPES[name] != status:
                wrong.append(f"{doc.name}:{text.count(chr(10), 0, match.start()) + 1}: {status} {name}")
    assert not wrong, wrong


def status_and_types(call: ast.Call) -> tuple[list[int], list[str]]:
    """The HTTP error statuses written as literals in ``call``'s own arguments, and the ``E.NAME`` types named."""
    arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
    statuses = [a.value for a in arguments if isinstance(a, ast.Constant) and type(a.value) is int
                and 400 <= a.value < 600]
    types = [node.value.attr for argument in arguments for node in ast.walk(argument)
             if isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute)
             and isinstance(node.value.value, ast.Name) and node.value.value.id == "E"]
    return statuses, types


def test_the_code_answers_each_error_type_with_its_own_status() -> None:
    """A call that gives a literal status with an ``E.NAME`` type (``EngineRefused(502, {"error": {"type":
    E.ENGINE_FAILED.name ...}})``) gives the type's own status: docs/api.md promises one status per type."""
    wrong = []
    for package in ("lb", "node_sidecar", "node_engine", "handoff"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                statuses, types = status_and_types(node)
                for status in statuses:
                    for name in types:
                        if getattr(E, name).status != status:
                            wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {status} {getattr(E, name).name}")
    assert not wrong, wrong
