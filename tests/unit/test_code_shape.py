"""The code-shape limits of the repository's standards, on every Python file of the tree.

- A file holds at most 450 lines, tests included; `kernels/` (Triton and CUDA-facing ops) is exempt.
- A function (or method) spans at most 60 lines, `def` line to last line, its nested functions counted in its span.

Generated protobuf code (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) and the frozen baseline in `bench/baselines/`
are exempt from both; so are folders that are not the project's (hidden ones such as `.venv`, build outputs).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
FROZEN = (("bench", "baselines"),)
NOT_OURS = ("build", "dist", "node_modules", "__pycache__")
FILE_LIMIT_EXEMPT = ("kernels",)


def project_files(root: Path) -> Iterator[Path]:
    """The project's .py files under root, generated code and the frozen baseline left out."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in NOT_OURS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        if path.name.endswith(GENERATED) or any(parts[:len(f)] == f for f in FROZEN):
            continue
        yield path


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, span) of every function whose span is over the limit."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def over_limits(root: Path) -> tuple[list[str], list[str]]:
    """(files over the line limit, functions over theirs), each as `path: ...` lines."""
    files, functions = [], []
    for path in project_files(root):
        rel, source = path.relative_to(root), path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_FILE_LINES and rel.parts[0] not in FILE_LIMIT_EXEMPT:
            files.append(f"{rel}: {lines} lines")
        functions += [f"{rel}:{line} {name}: {span} lines" for name, line, span in long_functions(source)]
    return files, functions


def test_no_file_over_450_lines():
    files, _ = over_limits(ROOT)
    assert not files, f"files over {MAX_FILE_LINES} lines:\n  " + "\n  ".join(files)


def test_no_function_over_60_lines():
    _, functions = over_limits(ROOT)
    assert not functions, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(functions)


def test_the_limits_catch_long_files_and_functions(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(58))
    nested = "def outer():\n    def inner():\n" + body.replace("    ", "        ") + "    return inner\n"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fits.py").write_text("def fits():\n" + body + "    return 0\n")  # 60 lines
    (tmp_path / "pkg" / "nested.py").write_text(nested)  # outer: 61 lines, inner: 59
    (tmp_path / "pkg" / "long.py").write_text("x = 0\n" * 451)
    (tmp_path / "pkg" / "big_pb2.py").write_text("x = 0\n" * 451)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "op.py").write_text("x = 0\n" * 451)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "dep.py").write_text("x = 0\n" * 451)
    files, functions = over_limits(tmp_path)
    assert files == ["pkg/long.py: 451 lines"]
    assert functions == ["pkg/nested.py:1 outer: 61 lines"]
