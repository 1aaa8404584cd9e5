#!/usr/bin/env python3
"""Counts `unsafe` in the Rust sources, per file, and checks the table in docs/security.md.

    scripts/unsafe_inventory.py           prints the table (Markdown)
    scripts/unsafe_inventory.py --check   fails when docs/security.md's table differs
    scripts/unsafe_inventory.py --write   rewrites that table

Counted per file (comments left out): unsafe blocks, `unsafe impl`s, and `unsafe fn` definitions
(C-ABI exports among them); function-pointer types (`unsafe extern "C" fn(...)`) are types, not
code, and are not counted. That every block and impl has a `// SAFETY:` comment is checked by
clippy's undocumented_unsafe_blocks lint (Cargo.toml [lints]), which CI runs with -D warnings.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
BEGIN, END = "<!-- unsafe-inventory:begin -->", "<!-- unsafe-inventory:end -->"
DIRS = ["src", "tests", "build.rs"]  # the atlas package; fuzz/ is a crate of its own

BLOCK = re.compile(r"\bunsafe\s*\{")
IMPL = re.compile(r"\bunsafe\s+impl\b")
RAW = re.compile(r'b?r(#*)"')
FN = re.compile(r"\bunsafe\s+(?:extern\s+\"[^\"]*\"\s+)?fn\s+\w")


def code_only(text: str) -> str:
    """The text without comments (line and block) and string literals' contents."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif (m := RAW.match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            j = text.find('"' + m.group(1), m.end())
            out.append('""')
            i = n if j < 0 else j + 1 + len(m.group(1))
        elif c == '"' and not text[max(0, i - 1)] == "'":
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def inventory():
    rows = []
    for d in DIRS:
        base = ROOT / d
        files = [base] if base.is_file() else sorted(base.rglob("*.rs")) if base.is_dir() else []
        for f in files:
            code = code_only(f.read_text(encoding="utf-8"))
            counts = (len(BLOCK.findall(code)), len(IMPL.findall(code)), len(FN.findall(code)))
            if any(counts):
                rows.append((f.relative_to(ROOT).as_posix(), *counts))
    return rows


def table(rows):
    lines = ["| file | unsafe blocks | unsafe impls | unsafe fns |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| `{f}` | {b} | {i} | {fn} |" for f, b, i, fn in rows]
    tb, ti, tf = (sum(r[k] for r in rows) for k in (1, 2, 3))
    lines.append(f"| **total** | **{tb}** | **{ti}** | **{tf}** |")
    return "\n".join(lines)


def main():
    text = table(inventory())
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if not mode:
        print(text)
        return 0
    doc = DOC.read_text(encoding="utf-8")
    if BEGIN not in doc or END not in doc:
        print(f"{DOC}: no {BEGIN} ... {END} section", file=sys.stderr)
        return 1
    head, rest = doc.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    if mode == "--write":
        DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")
        return 0
    if mode == "--check":
        if old.strip() != text.strip():
            print("docs/security.md's unsafe inventory is stale; scripts/unsafe_inventory.py --write makes it:", file=sys.stderr)
            print(text, file=sys.stderr)
            return 1
        print("unsafe inventory: docs/security.md matches the sources")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
