"""docs/requirements.md is where the requirement IDs that code, docs and tests cite (`req P-7`,
`(O-4)`) resolve: every cited ID has an entry there, and every test an entry names exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "requirements.md"
SCANNED = ("engine", "frontend", "postproc", "shared", "tests", "docs", "deploy", "benchmarks")
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".txt", ".json", ".cpp"}
ID = re.compile(r"\b([A-Z]{1,2})-(\d+|\*)(?![\w-])")
ENTRY = re.compile(r"^- \*\*([A-Z]{1,2}-\d+)\*\*", re.MULTILINE)
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _scanned_files():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and (path.suffix in SUFFIXES or path.name == "Dockerfile") \
                    and "__pycache__" not in path.parts:
                yield path


def _entries() -> dict[str, str]:
    """Each ID's entry text, up to the next entry or heading."""
    text = DOC.read_text()
    starts = [(m.group(1), m.start()) for m in ENTRY.finditer(text)]
    entries = {}
    for i, (ident, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else len(text)
        entries[ident] = text[start:end].split("\n## ")[0]
    return entries


def test_every_cited_id_has_an_entry():
    entries = _entries()
    letters = {ident.split("-")[0] for ident in entries}
    missing = {}
    for path in _scanned_files():
        if path == DOC:
            continue
        for m in ID.finditer(path.read_text(errors="replace")):
            letter, number = m.groups()
            known = letter in letters if number == "*" else f"{letter}-{number}" in entries
            if not known:
                missing.setdefault(m.group(0), str(path.relative_to(ROOT)))
    assert not missing, f"IDs cited but not in docs/requirements.md (ID: first file): {missing}"


def test_ids_are_cited_as_req_not_as_an_outside_spec():
    """The IDs' old prefix pointed at a file outside the repository."""
    old = re.compile(r"\bSPEC(\s+#?\s*)[A-Z]{1,2}-(\d+|\*)")
    found = [str(p.relative_to(ROOT)) for p in _scanned_files()
             if p != DOC and old.search(p.read_text(errors="replace"))]
    assert not found, f"cite requirements as 'req X-n' (docs/requirements.md): {found}"


def test_every_entry_names_tests_that_exist():
    entries = _entries()
    assert len(entries) >= 40
    defined: dict[str, set[str]] = {}
    problems = []
    for ident, text in entries.items():
        refs = TEST_REF.findall(text)
        if not refs:
            problems.append(f"{ident}: names no test")
        for file, name in refs:
            if file not in defined:
                path = ROOT / file
                tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[])
                defined[file] = {n.name for n in ast.walk(tree)
                                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            if name not in defined[file] or not name.startswith("test_"):
                problems.append(f"{ident}: {file}::{name} does not exist")
    assert not problems, "\n".join(problems)


def test_entries_are_unique_and_in_order_within_each_letter():
    idents = ENTRY.findall(DOC.read_text())
    assert len(idents) == len(set(idents))
    by_letter: dict[str, list[int]] = {}
    for ident in idents:
        letter, number = ident.split("-")
        by_letter.setdefault(letter, []).append(int(number))
    assert all(numbers == sorted(numbers) for numbers in by_letter.values())
