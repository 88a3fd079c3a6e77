"""No service flag is written by hand: every `add_argument` in product code is the generator's
(telemetry/options.py) or one of the command lines listed here, which are not services' options."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NOT_PRODUCT = ("tests", "bench", "servebench")  # test code, benchmark scripts, `kdamesh bench serve` (vLLM's flags)
ANY = None
# path -> the first arguments its add_argument calls may have ("?": not a literal), ANY: the whole file.
ALLOWED: dict[str, set[str] | None] = {
    "telemetry/options.py": {"?"},  # the generator: parser.add_argument(*flag.names, ...)
    "deploy/mesh_plan.py": {"model"},  # `serve MODEL`: the positional stands for `--model`
    # the top-level command line: the role switch, make-checkpoint (a generated checkpoint's preset, seed, dtype)
    # and train-demo / distill-demo (their TrainConfig / DistillConfig fields, "?"; OUT_DIR the trained folder)
    "deploy/cli.py": {"--role", "--preset", "out_dir", "--seed", "--dtype", "--max-shard-mb", "--experts-format", "?",
                      "--tiny"},
    "deploy/plan_cli.py": ANY,  # `kdamesh plan`: a sizing calculator, no service
    "engine/tokenizer_build.py": ANY,  # builds the demo tokenizer files (a developer tool)
    "protos/build.py": ANY,  # regenerates the protobuf code (a developer tool)
}


def hand_written_flags(root: Path) -> list[str]:
    """`path:line first-argument` of every `add_argument` call under `root` that ALLOWED does not list."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in NOT_PRODUCT or "/." in f"/{rel}":
            continue
        allowed = ALLOWED.get(rel, set())
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                first = node.args[0] if node.args else None
                name = first.value if isinstance(first, ast.Constant) else "?"
                if allowed is not ANY and name not in allowed:
                    found.append(f"{rel}:{node.lineno} {name}")
    return found


def test_no_flag_is_defined_by_hand_outside_the_tree():
    assert hand_written_flags(ROOT) == [], "declare the flag on its options dataclass (telemetry/options.py)"


def test_a_stray_add_argument_is_caught(tmp_path):
    """Negative control: a hand-written flag in a module of a product package fails the check."""
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "stray.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--stray-flag', type=int)\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "script.py").write_text("p.add_argument('--fine-here')\n")
    assert hand_written_flags(tmp_path) == ["gateway/stray.py:3 --stray-flag"]
