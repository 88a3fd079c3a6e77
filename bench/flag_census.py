"""Counts the command-line flags of a kdamesh tree and how often each is declared or written by hand.

`python -m bench.flag_census [ROOT]` (default: this checkout) reads every .py file's syntax tree, nothing imported:
- a declaration is one `add_argument(...)` call or one `option(...)` field of the options tree (telemetry/options.py)
  with its literal `--names`; a factory that returns one `option(...)` counts once however many fields use it;
- "declared more than once": a flag name that two or more declarations carry (another default, help or meaning);
- "written as a literal": every string constant that is exactly a flag name (`"--snapshot-policy"`) outside
  declarations, e.g. a hand-built argv list.
Each count is given for product code (everything but tests/, bench/ and servebench/) and for the whole tree.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
NOT_PRODUCT = ("tests", "bench", "servebench")


def _declared(call: ast.Call) -> list[str]:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if name not in ("add_argument", "option"):
        return []
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            and FLAG.match(a.value)]


def census(root: Path, product_only: bool) -> dict[str, object]:
    declarations: Counter[str] = Counter()
    literals: Counter[str] = Counter()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if {".git", ".venv"} & set(rel.parts) or (product_only and rel.parts[0] in NOT_PRODUCT):
            continue
        in_declaration = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                names = _declared(node)
                declarations.update(names)
                in_declaration |= {id(a) for a in node.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and FLAG.match(node.value) \
                    and id(node) not in in_declaration:
                literals[node.value] += 1
    repeated = sorted(f for f, n in declarations.items() if n > 1)
    return {"distinct flags": len(declarations), "declared more than once": len(repeated), "those": repeated,
            "flag literals outside declarations": sum(literals.values()),
            "--snapshot-policy literals": literals["--snapshot-policy"] + declarations["--snapshot-policy"]}


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    for label, product_only in (("product code", True), ("whole tree", False)):
        result = census(root, product_only)
        print(f"{label}:")
        for key, value in result.items():
            print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
