"""Regenerates the Python of every `protos/*.proto`: `python -m protos.build [--out DIR]`.

Runs `grpc_tools.protoc` from the repository root with `-I .` on the paths `protos/*.proto`, so the generated modules
import each other as `from protos import common_pb2` and land in `protos/` (or in `DIR/protos/` with `--out`, which
the staleness test uses). Output is deterministic for a given grpcio-tools version.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(repo_root: Path = REPO_ROOT) -> list[str]:
    """The `.proto` files, as paths relative to the repository root, sorted."""
    return sorted(p.relative_to(repo_root).as_posix() for p in (repo_root / PROTO_DIR).glob("*.proto"))


def generated_names(repo_root: Path = REPO_ROOT) -> list[str]:
    """File names `generate` writes into `<out>/protos/`, sorted."""
    stems = [Path(p).stem for p in proto_files(repo_root)]
    return sorted(stem + suffix for stem in stems for suffix in GENERATED_SUFFIXES)


def generate(out_root: Path = REPO_ROOT, repo_root: Path = REPO_ROOT) -> list[Path]:
    """Runs protoc; returns the written files. Raises RuntimeError when protoc fails."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{repo_root}", f"-I{well_known}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(repo_root / p) for p in proto_files(repo_root)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / PROTO_DIR / name for name in generated_names(repo_root)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
