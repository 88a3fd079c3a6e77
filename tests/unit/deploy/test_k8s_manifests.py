"""The Kubernetes manifests (deploy/k8s), validated offline (tests/unit/deploy/deploy_files.py): every file in base
and everything `kubectl kustomize` renders from the base and the overlays validates strictly against the Kubernetes
schemas; on top of them: probes, PodDisruptionBudgets, the decode HPA, resource requests, Services that select pods,
addresses that resolve to Service ports, GPU requests in the gpu overlay and none in the cpu one, the model PVC."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from tests.unit.deploy.deploy_files import (GPU, GRPC_PORTS, ROLES, ROOT, K8S, all_containers, base_manifest_files,
                                            by_kind, gpu_with_model_pvc, kdamesh_commands_k8s, kustomize, pod_spec,
                                            role_of, selects, validate_k8s)


@pytest.mark.parametrize("path", base_manifest_files(), ids=lambda p: p.name)
def test_base_manifest_files_validate(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate_k8s(doc, str(path.relative_to(ROOT)))


def test_every_base_manifest_file_is_a_kustomize_resource():
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in base_manifest_files()}


def test_kustomize_renders_and_validates(rendered):
    rendering, docs = rendered
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


def test_workloads_probes_budgets_and_requests(rendered):
    _, docs = rendered
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


def test_services_select_pods_and_addresses_resolve(rendered):
    _, docs = rendered
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
                host, port = address.removeprefix("dns:///").rsplit(":", 1)
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
