"""Worker security in the deployment files (issue 16 item 6), offline: no worker (cache, prefill, decode) or Redis
publishes a port or is reachable from outside its peers, every kdamesh service gets the mesh token from the
deployment's secret (Compose: a required variable; Kubernetes: a Secret), and a NetworkPolicy lets only the gateway
reach prefill/decode, only the workers reach the cache service, and only the cache service and workers reach Redis."""

from __future__ import annotations

import pytest

from tests.unit.deploy.deploy_files import (COMPOSE_TEST_TOKEN, GRPC_PORTS, ROLES, by_kind, compose_config,
                                            compose_run, kustomize, pod_spec, role_of, selects)

WORKERS = ("cache", "prefill", "decode")
# who may open a connection to whom (besides a service to itself): the mesh's only paths
ALLOWED = {"prefill": {"gateway"}, "decode": {"gateway"}, "cache": {"prefill", "decode"},
           "redis": {"cache", "prefill", "decode"}}
# Compose services that must share no network (the gateway never talks to the cache or Redis; telemetry to no Redis)
COMPOSE_APART = (("gateway", "cache"), ("gateway", "redis"), ("otel-collector", "redis"), ("jaeger", "cache"),
                 ("jaeger", "prefill"), ("jaeger", "decode"), ("jaeger", "redis"))
RENDERINGS = ("deploy/k8s/base", "deploy/k8s/overlays/cpu", "deploy/k8s/overlays/gpu", "deploy/k8s/overlays/gpu-k3")


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_compose_publishes_no_worker_and_passes_the_token(gpu):
    config = compose_config(gpu)
    services, networks = config["services"], config["networks"]
    for role in (*WORKERS, "redis"):
        assert not services[role].get("ports"), f"{role} must not publish a port on the host"
    for role in ROLES:
        assert services[role]["environment"]["KDAMESH_MESH_TOKEN"] == COMPOSE_TEST_TOKEN, role
    joined = {name: set(s.get("networks") or {}) for name, s in services.items()}
    assert services["make-checkpoint"].get("network_mode") == "none"
    # Compose networks are symmetric (peers on one network reach each other): check the paths that must not exist.
    for a, b in COMPOSE_APART:
        assert not joined[a] & joined[b], f"{a} and {b} share the networks {joined[a] & joined[b]}"
    for target, callers in ALLOWED.items():
        for caller in callers:
            assert joined[caller] & joined[target], f"{caller} cannot reach {target}"
    for name in set().union(*(joined[w] for w in (*WORKERS, "redis"))):
        assert networks[name].get("internal") is True, f"network {name} of the workers must be internal"


def test_compose_refuses_to_start_without_a_token():
    out = compose_run(mesh_token=None)
    assert out.returncode != 0 and "KDAMESH_MESH_TOKEN" in out.stderr


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_k8s_token_from_a_secret_and_no_published_workers(rendering):
    docs = kustomize(rendering)
    for name, deployment in by_kind(docs, "Deployment").items():
        role = role_of(deployment)
        main = pod_spec(deployment)["containers"][0]
        assert all("hostPort" not in p for p in main.get("ports", [])), f"{name} uses a hostPort"
        if role in ROLES:
            (token,) = [e for e in main.get("env", []) if e["name"] == "KDAMESH_MESH_TOKEN"]
            assert token["valueFrom"]["secretKeyRef"] == {"name": "kdamesh-mesh-token", "key": "token"}, name
    for name, service in by_kind(docs, "Service").items():
        if name != "kdamesh-gateway":
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP", f"{name} is exposed outside the cluster"


def _ingress_sources(policies: dict, labels: dict, port: int) -> list[dict]:
    """The `from` peers of every policy selecting a pod with `labels` that admit TCP `port` ([{}]: anyone)."""
    peers = []
    for policy in policies.values():
        if not selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is None or any(p.get("port") in (port, None) for p in ports):
                peers.extend(rule.get("from") or [{}])
    return peers


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_k8s_network_policy_admits_only_the_mesh_paths(rendering):
    docs = kustomize(rendering)
    policies = by_kind(docs, "NetworkPolicy")
    deny = [p for p in policies.values() if p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]
            and not p["spec"].get("ingress")]
    assert deny, "no default-deny ingress policy"
    pods = {role_of(d): d["spec"]["template"]["metadata"]["labels"] for d in by_kind(docs, "Deployment").values()}
    ports = {**GRPC_PORTS, "redis": 6379}
    for target, callers in ALLOWED.items():
        peers = _ingress_sources(policies, pods[target], ports[target])
        assert peers and all(set(p) == {"podSelector"} for p in peers), f"{target}: open to {peers}"
        admitted = {role for role, labels in pods.items() if any(selects(p["podSelector"], labels) for p in peers)}
        assert admitted == callers, f"{target} admits {admitted}, not {callers}"
    assert _ingress_sources(policies, pods["gateway"], 8000) == [{}], "the gateway's API must stay open"
