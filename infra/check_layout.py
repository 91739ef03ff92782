#!/usr/bin/env python3
"""The house's shape, checked: no product source file over its size limit, no module cycle.

A newcomer changes one thing by reading a few small files named for their job. Two things
undo that quietly, one commit at a time: a file that grows until it holds several jobs, and
modules that import each other (so neither can be read, or moved, alone). This check fails
on either, for the product crates (shared/, functions/, local/, ops/). The test harnesses
under tests/ are not held to it.

- Size: a file's source lines, not counting a trailing `#[cfg(test)] mod tests { .. }` block;
  files named `tests.rs` are tests. Limit: MAX_LINES.
- Cycles: an edge a -> b for every `crate::`, `super::`, `self::` or child-module path in a
  that names b. An edge between a module and one of its ancestors is not counted (a parent
  re-exporting its children, a child using its parent's shared helpers); every other edge is
  lifted to the two siblings under the modules' nearest common ancestor, and a cycle among
  siblings fails.

Usage: python3 infra/check_layout.py [repo root] | --self-test
"""

import re
import sys
from pathlib import Path

MAX_LINES = 600
CRATES = ["shared/src", "shared/time/src", "functions/*/src", "local/src", "ops/src"]

PATH_RE = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([A-Za-z_][A-Za-z0-9_]*)::", re.M)


def source_lines(text: str) -> int:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and lines[i + 1].startswith("mod tests {"):
            return i
    return len(lines)


def module_of(root: Path, f: Path) -> tuple:
    rel = f.relative_to(root).with_suffix("")
    parts = rel.parts
    if parts in (("lib",), ("main",)):
        return ()
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.split("\n"))


def resolve(modules: set, here: tuple, head: str, rest: list) -> tuple | None:
    if head == "crate":
        base = ()
    elif head == "self":
        base = here
    else:
        base = here
        while rest and rest[0] == "super":
            rest = rest[1:]
            base = base[:-1]
        base = base[:-1]
    found = None
    path = base
    if path in modules:
        found = path
    for part in rest:
        path = path + (part,)
        if path in modules:
            found = path
        else:
            break
    return found


def is_ancestor(a: tuple, b: tuple) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def check_crate(root: Path, problems: list) -> None:
    files = sorted(p for p in root.rglob("*.rs") if p.name != "tests.rs" and "tests" not in p.relative_to(root).parts[:-1])
    modules = {module_of(root, f): f for f in files}
    mods = set(modules)
    edges = {}
    for mod, f in modules.items():
        text = f.read_text()
        n = source_lines(text)
        if n > MAX_LINES:
            problems.append(f"{f}: {n} source lines (limit {MAX_LINES}); split it by responsibility")
        body = strip_comments(text)
        cut = body.find("#[cfg(test)]\nmod tests {")
        if cut >= 0:
            body = body[:cut]
        targets = set()
        for m in PATH_RE.finditer(body):
            rest = [p for p in m.group(2).split("::") if p]
            t = resolve(mods, mod, m.group(1), rest)
            if t is not None:
                targets.add(t)
        for m in USE_RE.finditer(body):
            child = mod + (m.group(1),)
            if child in mods:
                targets.add(child)
        for t in targets:
            if t == mod or is_ancestor(t, mod) or is_ancestor(mod, t):
                continue
            k = 0
            while k < min(len(t), len(mod)) and t[k] == mod[k]:
                k += 1
            a, b = mod[: k + 1], t[: k + 1]
            edges.setdefault(a, {}).setdefault(b, (f, t))
    # Cycles among siblings: any edge a -> b with a path b -> a.
    def reaches(src, dst, seen):
        if src == dst:
            return True
        seen.add(src)
        return any(n not in seen and reaches(n, dst, seen) for n in edges.get(src, {}))

    reported = set()
    for a, outs in sorted(edges.items()):
        for b, (f, t) in sorted(outs.items()):
            key = frozenset((a, b))
            if key in reported:
                continue
            if reaches(b, a, set()):
                reported.add(key)
                name = lambda m: "::".join(m) or "crate"
                problems.append(
                    f"{root}: module cycle between `{name(a)}` and `{name(b)}` ({f.relative_to(root)} uses {name(t)}, and back)"
                )


def self_test() -> int:
    """The check fails on what it is for: a sibling cycle, an oversize file; passes the rest."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "shared/src"
        (src / "store").mkdir(parents=True)
        (src / "lib.rs").write_text("pub mod domain;\npub mod store;\n")
        (src / "store.rs").write_text("mod queue;\npub use queue::Q;\n")
        (src / "store/queue.rs").write_text("use super::super::domain::Task;\npub struct Q;\n")
        (src / "domain.rs").write_text("pub struct Task;\n#[cfg(test)]\nmod tests {\n" + "fn f() {}\n" * 700 + "}\n")
        clean = []
        check_crate(src, clean)
        (src / "domain.rs").write_text("use crate::store::Q;\npub struct Task;\n" + "fn f() {}\n" * 601)
        dirty = []
        check_crate(src, dirty)
    cycle = [p for p in dirty if "module cycle between `domain` and `store`" in p]
    size = [p for p in dirty if "domain.rs: 60" in p]
    ok = not clean and len(cycle) == 1 and len(size) == 1 and len(dirty) == 2
    print(f"layout self-test: {'ok' if ok else 'FAILED'} (clean tree: {clean}; bad tree: {dirty})")
    return 0 if ok else 1


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    problems = []
    roots = [r for pattern in CRATES for r in sorted(repo.glob(pattern))]
    for root in roots:
        check_crate(root, problems)
    for p in problems:
        print(p)
    if problems:
        print(f"layout: {len(problems)} problem(s)")
        return 1
    print(f"layout: ok ({len(roots)} crates, no source file over {MAX_LINES} lines, no module cycle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
