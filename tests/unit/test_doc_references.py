"""The repo stands alone: every repository path (`engine/config.py`, `docs/api.md`, `deploy/models/demo-k3`) and
every dotted first-party name (`engine.memory.hit_rule`, `telemetry.units.parse_bytes`) that docs/*.md, README.md or
a module docstring mentions exists, and so does every `Class.attribute` of a first-party class; nothing names a file
outside the clone (a markdown file that is not in the repository, a path climbing out with `../`, an absolute
path of the machine the repository was built on).

Read without importing anything: paths against the working tree, names against the syntax trees of the modules
they name (what a module defines at top level; what a class, or a first-party class it derives from, defines in its
body or assigns to `self`). A module is parsed only when a name points into it, so the check stays fast."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
PATH = re.compile(r"(?<![\w./$~-])(\.\./)*[A-Za-z_][\w.*<>{}$-]*(/[\w.*<>{}$-]+)+/?")
BARE_DOC = re.compile(r"(?<![\w./-])[A-Z][A-Z_]+\.md\b")  # README.md: must exist at the root or in docs/
DOTTED = re.compile(r"(?<![\w./-])[a-z_][a-z0-9_]*(\.[A-Za-z_]\w*)+(?![\w(])")
CLASS_ATTR = re.compile(r"`([A-Z]\w*)\.([A-Za-z_]\w*)")
CLASS_DEF = re.compile(r"^\s*class (\w+)", re.M)
DOCSTRING = re.compile(r'\A(?:\s*#[^\n]*\n|\s)*[rRuU]?("""|\'\'\')(.*?)\1', re.S)
FILE_TAILS = ("proto", "py", "md", "json", "txt", "yaml", "yml", "toml", "svg", "sh", "safetensors", "model")
BUILD_MACHINE = re.compile(r"(?<![\w.])/work/[\w./-]+")
NOT_PATHS = re.compile(r"deploy/kdamesh-[\w-]+")  # kubectl's TYPE/NAME (`rollout status deploy/kdamesh-gateway`)


@cache
def sources(root: Path) -> dict[str, str]:
    """Repository-relative path -> text of every first-party Python file but generated code."""
    found = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIP_DIRS & set(rel.parts) and not GENERATED.search(path.name):
            found[rel.as_posix()] = path.read_text()
    return found


def _module_file(root: Path, dotted: str) -> str | None:
    rel = dotted.replace(".", "/")
    return next((f for f in (f"{rel}.py", f"{rel}/__init__.py") if f in sources(root)), None)


@cache
def _syntax(root: Path, rel: str) -> ast.Module:
    return ast.parse(sources(root)[rel], rel)


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@cache
def _class_files(root: Path) -> dict[str, list[str]]:
    """Class name -> the files defining a class of that name."""
    files: dict[str, list[str]] = {}
    for rel, text in sources(root).items():
        for name in set(CLASS_DEF.findall(text)):
            files.setdefault(name, []).append(rel)
    return files


@cache
def class_attributes(root: Path, name: str) -> frozenset[str] | None:
    """What the first-party classes called `name` define (with their first-party bases'), None when there is none."""
    found: set[str] | None = None
    for rel in _class_files(root).get(name, ()):
        for node in ast.walk(_syntax(root, rel)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                found = (found or set()) | _top_level_names(node.body)
                found |= {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                          and isinstance(a.value, ast.Name) and a.value.id in ("self", "cls")}
                for base in node.bases:
                    inherited = class_attributes(root, base.id) if isinstance(base, ast.Name) else None
                    found |= inherited or set()
    return None if found is None else frozenset(found)


def texts(root: Path = ROOT):
    """(where, text) of docs/*.md, README.md and every module docstring."""
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        yield doc.relative_to(root).as_posix(), doc.read_text()
    for rel, text in sources(root).items():
        match = DOCSTRING.match(text)
        if match:
            yield rel, match.group(2)


def _path_exists(root: Path, where: str, text: str) -> bool:
    if any(c in text for c in "<>{}*$"):
        return True  # a pattern, not a path
    if text.startswith("../"):  # fine only where the rest is a path inside the clone (a kustomize `../../x`)
        tail = text.lstrip("./")
        return any(p.as_posix().endswith(tail) for p in root.rglob(Path(tail).name))
    base = (root / where).parent
    return any((start / text.rstrip("/")).exists() for start in (root, base, root / "docs"))


def _checked_path(root: Path, text: str) -> bool:
    """Paths this test checks: those starting with a folder of the repository, or climbing out of one (`../`)."""
    inside = (root / text.split("/")[0]).is_dir() and not NOT_PATHS.fullmatch(text)
    return text.startswith("../") or inside or text.endswith(".md")


def _name_exists(root: Path, dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        rel = _module_file(root, ".".join(parts[:cut]))
        if rel is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if rest[0] not in _top_level_names(_syntax(root, rel).body):
            return False
        attributes = class_attributes(root, rest[0]) if len(rest) > 1 else None
        return attributes is None or rest[1] in attributes
    return False


def broken_references(root: Path = ROOT) -> list[str]:
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    broken = []
    for where, text in texts(root):
        for match in PATH.finditer(text):
            ref = match.group(0).rstrip(".")
            if _checked_path(root, ref) and not _path_exists(root, where, ref):
                broken.append(f"{where}: path {ref}")
        broken += [f"{where}: path {m.group(0)}" for m in BUILD_MACHINE.finditer(text)]
        for match in BARE_DOC.finditer(text):
            if not any((root / d / match.group(0)).is_file() for d in (".", "docs")):
                broken.append(f"{where}: file {match.group(0)}")
        for match in DOTTED.finditer(text):
            ref = match.group(0).rstrip(".")
            checked = ref.split(".")[0] in packages and ref.rsplit(".", 1)[1] not in FILE_TAILS
            if checked and not _name_exists(root, ref):
                broken.append(f"{where}: name {ref}")
        for cls, attr in CLASS_ATTR.findall(text):
            attributes = class_attributes(root, cls)
            if attributes is not None and attr not in attributes:
                broken.append(f"{where}: name {cls}.{attr}")
    return broken


def test_every_path_and_name_the_docs_mention_exists():
    assert broken_references() == []


def test_broken_references_are_caught(tmp_path):
    """Negative control: a made-up path, module, function, method and an outside file are each reported."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""Uses `pkg.mod.real` and `pkg.mod.gone`, `Engine.step` and `Engine._update`, pkg/mod.py and pkg/nope.py,\n'
        'pkg.missing, ../shared/DESIGN.md, shared/DESIGN.md, /work/run/x and DESIGN.md."""\n'
        "def real(): pass\n\nclass Engine:\n    def step(self): pass\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("See docs/guide.md and pkg/mod.py.\n")
    assert broken_references(tmp_path) == [
        "README.md: path docs/guide.md",
        "pkg/mod.py: path pkg/nope.py", "pkg/mod.py: path ../shared/DESIGN.md", "pkg/mod.py: path shared/DESIGN.md",
        "pkg/mod.py: path /work/run/x", "pkg/mod.py: file DESIGN.md",
        "pkg/mod.py: name pkg.mod.gone", "pkg/mod.py: name pkg.missing", "pkg/mod.py: name Engine._update"]
