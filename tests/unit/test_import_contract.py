"""The import layers of docs/architecture.md ("Layers of the code", downward only), checked on every first-party module.

One table, `LAYERS`, holds the rule of each top-level package (a folder of the repository root with an
`__init__.py`; `tests/` is not checked). Every import counts, wherever it stands: module-level ones, lazy ones inside
functions, `importlib.import_module("...")` / `__import__("...")` with a literal name, and the string values of a
package's `_LAZY` map (engine/__init__.py imports those on attribute access). A package may always import itself;
nothing but `bench` imports `bench` or `tests`. Where a rule names third-party roots, anything else outside the standard library
is a violation too. A first-party package without a rule fails, so a new package gets one.

No import cycles inside a package: among the modules of one top-level package, the graph of every import (the same
imports as above, `TYPE_CHECKING` ones included: a cycle hidden there is still two modules that need each other) has
no cycle (`package_cycles`).

A subprocess check adds what static parsing cannot see: importing every module of the torch-free packages loads no
torch (nor the model code) through whatever they import in turn.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANY = "*"  # in Layer.first_party: every first-party package (but those in BENCH_ONLY)
UNCHECKED = ("tests",)  # first-party but not checked here
BENCH_ONLY = ("bench", "tests")  # importable by bench alone


@dataclass(frozen=True)
class Layer:
    """What one top-level package may import besides itself.

    first_party: module prefixes from other first-party packages ("engine.tokenizer" admits that module and its
    submodules; ANY admits all of them but BENCH_ONLY). third_party: the roots admitted besides the standard library,
    or None where the rule leaves third-party imports open. exceptions: (module, roots) pairs, one module's extra
    third-party roots.
    """

    first_party: tuple[str, ...]
    third_party: tuple[str, ...] | None = None
    exceptions: tuple[tuple[str, tuple[str, ...]], ...] = ()


# The engine's torch-free modules (the gateway renders, tokenizes and hashes blocks without the model).
ENGINE_TORCH_FREE = ("engine.tokenizer", "engine.formats", "engine.memory.hashing", "engine.memory.hit_rule",
                     "engine.vision.processor")
# What a worker may use of the cache service: the client, its value types and data planes, the object encoding, and
# the KV event stream's publisher (shared by the workers' and the cache service's streams).
CACHE_CLIENT = ("cache_service.client", "cache_service.client_types", "cache_service.data_plane",
                "cache_service.objects", "cache_service.kv_stream")
GRPC = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf")
WORKER_SIDE = ("worker", "engine", "kernels", "protos", *CACHE_CLIENT, "telemetry")

LAYERS: dict[str, Layer] = {
    "deploy": Layer((ANY,)),
    "bench": Layer((ANY,)),
    # `kdamesh train-demo`: trains the demo K3 model through the engine's modules, renders chat with the gateway's K3
    # renderer (torch-free); torch, the `tokenizers` trainer and safetensors only.
    "trainer": Layer(("engine", "kernels", "gateway.chat"), third_party=("torch", "tokenizers", "safetensors")),
    # `kdamesh bench serve`'s load generator (moved out of bench/ so the CLI may import it): an HTTP client.
    "servebench": Layer(("sdk", "protos", "gateway", "telemetry", *ENGINE_TORCH_FREE)),
    "gateway": Layer(("protos", "telemetry", *ENGINE_TORCH_FREE)),
    "prefill_service": Layer(WORKER_SIDE),
    "decode_service": Layer(WORKER_SIDE),
    "worker": Layer(("engine", "kernels", "protos", *CACHE_CLIENT, "telemetry")),
    "cache_service": Layer(("protos", "telemetry"),
                           third_party=(*GRPC, "redis", "xxhash", "prometheus_client", "opentelemetry")),
    "sdk": Layer(("protos",), third_party=("grpc", "google")),
    "engine": Layer(("kernels", "telemetry")),
    "protos": Layer((), third_party=("grpc", "google.protobuf"), exceptions=(("protos.build", ("grpc_tools",)),)),
    "kernels": Layer((), third_party=("torch", "triton", "flashinfer", "numpy")),
    "telemetry": Layer((), third_party=(*GRPC, "opentelemetry", "prometheus_client")),
}

# Importing any module of these loads none of the listed modules (or their submodules).
TORCH_FREE = {
    "gateway": ("torch", "kernels", "engine.model"),
    "sdk": ("torch", "engine", "kernels", "gateway"),
    "protos": ("torch", "engine", "kernels"),
    "cache_service": ("torch", "engine", "kernels"),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # the imported module, dotted and absolute

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def first_party_packages(root: Path) -> set[str]:
    return {p.parent.name for p in root.glob("*/__init__.py")}


def module_index(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of one top-level package."""
    index = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        index[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return index


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _literal_import(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value if isinstance(node.args[0].value, str) else None
    return None


def _lazy_map(node: ast.Assign) -> list[str]:
    named = any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
    if not named or not isinstance(node.value, ast.Dict):
        return []
    return [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def imports_of(path: Path, module: str, known: set[str]) -> Iterator[Import]:
    """Every import of one file; `from a import b` counts as `a.b` where that is a first-party module."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call):
            targets = [t for t in [_literal_import(node)] if t]
        elif isinstance(node, ast.Assign):
            targets = _lazy_map(node)
        yield from (Import(module, node.lineno, t) for t in dict.fromkeys(targets))


def allowed(package: str, imp: Import, first_party: set[str]) -> bool:
    """Whether `package`'s rule admits one import."""
    layer, root = LAYERS[package], imp.target.split(".")[0]
    if root == package:
        return True
    if root in first_party:
        bench_only = root in BENCH_ONLY and package != "bench"
        return not bench_only and (ANY in layer.first_party or within(imp.target, layer.first_party))
    if root in sys.stdlib_module_names or layer.third_party is None:
        return True
    extra = tuple(r for module, roots in layer.exceptions if module == imp.module for r in roots)
    return within(imp.target, layer.third_party + extra)


def violations(root: Path, package: str) -> list[Import]:
    """The imports of one package that its rule in LAYERS does not admit, in file order."""
    first_party = first_party_packages(root)
    known = {m for p in first_party - set(UNCHECKED) for m in module_index(root, p)}
    return [imp for module, path in module_index(root, package).items()
            for imp in imports_of(path, module, known) if not allowed(package, imp, first_party)]


CHECKED = sorted(first_party_packages(ROOT) - set(UNCHECKED))


def test_every_first_party_package_has_a_rule():
    missing = sorted(set(CHECKED) - LAYERS.keys())
    assert not missing, f"top-level packages without a layer rule: {missing}; add each to LAYERS (see docs/architecture.md)"


@pytest.mark.parametrize("package", [p for p in CHECKED if p in LAYERS])
def test_imports_follow_the_layer_rules(package):
    found = violations(ROOT, package)
    assert not found, (f"{package} may import {LAYERS[package]}, but:\n  " + "\n  ".join(map(str, found)))


def test_the_rules_keep_prefill_and_decode_apart_and_bench_and_tests_on_top():
    first_party = set(LAYERS) | {"tests"}
    for a, b in (("prefill_service", "decode_service"), ("decode_service", "prefill_service")):
        assert not allowed(a, Import(f"{a}.x", 1, f"{b}.server"), first_party)
    assert [p for p in LAYERS if allowed(p, Import(f"{p}.x", 1, "bench.serve"), first_party)] == ["bench"]
    assert [p for p in LAYERS if allowed(p, Import(f"{p}.x", 1, "tests.model_driver"), first_party)] == ["bench"]
    assert not allowed("gateway", Import("gateway.x", 1, "engine.model.layers"), first_party)
    assert not allowed("cache_service", Import("cache_service.x", 1, "engine.transfer"), first_party)
    assert allowed("protos", Import("protos.build", 1, "grpc_tools.protoc"), first_party)
    assert not allowed("protos", Import("protos.other", 1, "grpc_tools.protoc"), first_party)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checker_reports_exactly_the_forbidden_imports(tmp_path):
    _write(tmp_path, {
        "engine/__init__.py": "", "engine/core.py": "", "protos/__init__.py": "", "protos/common_pb2.py": "",
        "kernels/__init__.py": "import torch\n",
        "kernels/bad.py": "import math\n\ndef f():\n    from engine import x\n    return x\n",
        "sdk/__init__.py": "from protos import common_pb2\nimport grpc\n",
        "sdk/bad.py": "import importlib\n\ndef g():\n    return importlib.import_module('engine.core')\n",
        "mystery/__init__.py": "",
    })
    assert [str(i) for i in violations(tmp_path, "kernels")] == ["kernels.bad:4 imports engine"]
    assert [str(i) for i in violations(tmp_path, "sdk")] == ["sdk.bad:4 imports engine.core"]
    assert sorted(first_party_packages(tmp_path) - LAYERS.keys()) == ["mystery"]


def test_the_checker_sees_lazy_maps_relative_imports_and_third_party_roots(tmp_path):
    _write(tmp_path, {
        "engine/__init__.py": "_LAZY = {'LLM': 'engine.llm', 'Bad': 'cache_service.server'}\n",
        "engine/llm.py": "from . import core\nfrom .core import step\n", "engine/core.py": "",
        "cache_service/__init__.py": "", "cache_service/server.py": "",
        "kernels/__init__.py": "", "kernels/op.py": "import numpy\nimport requests\n",
    })
    assert [str(i) for i in violations(tmp_path, "engine")] == ["engine:1 imports cache_service.server"]
    assert [str(i) for i in violations(tmp_path, "kernels")] == ["kernels.op:2 imports requests"]


def package_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (an import of a name inside a module, or of something
    below a known module, counts as that module)."""
    index = module_index(root, package)
    edges: dict[str, set[str]] = {m: set() for m in index}
    for module, path in index.items():
        for imp in imports_of(path, module, set(index)):
            target = imp.target
            while target not in index and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in index and target != module:
                edges[module].add(target)
    return edges


def package_cycles(root: Path, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module in `package`'s import graph, each sorted."""
    edges, order, low, stack, cycles = package_graph(root, package), {}, {}, [], []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(edges[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in order:
            visit(module)
    return cycles


@pytest.mark.parametrize("package", CHECKED)
def test_no_import_cycles_inside_a_package(package):
    cycles = package_cycles(ROOT, package)
    assert not cycles, f"modules of {package} that import each other (directly or around a loop): {cycles}"


def test_the_cycle_check_finds_cycles_hidden_behind_type_checking(tmp_path):
    _write(tmp_path, {
        "gateway/__init__.py": "", "gateway/text.py": "",
        "gateway/core.py": "from gateway.run import Run\nfrom gateway import text\n",
        "gateway/run.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.trace import T\n",
        "gateway/trace.py": "from gateway.core import Core\n",
    })
    assert package_cycles(tmp_path, "gateway") == [["gateway.core", "gateway.run", "gateway.trace"]]
    (tmp_path / "gateway/trace.py").write_text("from gateway.text import x\n")  # the loop broken
    assert package_cycles(tmp_path, "gateway") == []


@pytest.mark.parametrize("package", sorted(TORCH_FREE))
def test_importing_the_torch_free_packages_loads_no_torch(package):
    modules = sorted(m for m in module_index(ROOT, package) if not m.endswith("__main__"))
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out.splitlines()[-1])
    bad = {p: [m for m in loaded if within(m, (p,))] for p in TORCH_FREE[package]}
    assert not any(bad.values()), f"importing {package} loads " + "; ".join(
        f"{p} ({len(ms)} modules: {', '.join(ms[:4])}, ...)" for p, ms in bad.items() if ms)


# The options tree: what every `kdamesh` command line reads before any model code (docs/architecture.md, "Options
# and flags"), so `kdamesh up` refuses a busy port or a bad flag without loading torch.
OPTIONS_MODULES = ("telemetry.options", "engine.config", "prefill_service.config", "decode_service.config",
                   "cache_service.config", "gateway.config", "deploy.flags", "deploy.mesh_plan", "deploy.serve",
                   "deploy.launcher", "deploy.cli")


def _loaded_by(modules: tuple[str, ...]) -> list[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_options_tree_loads_no_torch():
    assert not [m for m in _loaded_by(OPTIONS_MODULES) if within(m, ("torch", "kernels"))]
    assert "torch" in _loaded_by(("engine.model.batch",))  # negative control: the check sees a torch import
