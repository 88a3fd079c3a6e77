"""The Kubernetes manifests scale out (issue 21), on every rendering: the pools are headless Services that the
gateway resolves pod by pod (`dns:///`), prefill is a pool of at least 2, every pool has a budget that keeps it
serving, every gateway replica reads one shared cache-salt Secret, the queue-depth HPAs read metrics the shipped
prometheus-adapter rules produce from series the workers export, and the K3 GPU overlay is what `kdamesh plan`
says the released K3 needs (8 GPUs and TP8 per pod, the KV budget, /dev/shm, NCCL, Redis and object sizes)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from engine.config import parse_bytes
from engine.model.config import load_model_config
from engine.plan import PlanArgs, plan
from gateway.discovery import DnsTarget, pool_target
from telemetry.vllm import ENGINE_SERIES
from tests.unit.deploy.deploy_files import (GPU, GRPC_PORTS, K8S, ROOT, by_kind, expanded_args, kustomize, pod_spec,
                                            selects)

SALT = "KDAMESH_CACHE_SALT_SECRET"
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
         "kb": 2**10, "mb": 2**20, "gb": 2**30}  # Kubernetes quantities, and Redis's `gb` (1024^3)


def quantity(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text)).groups()
    return int(number) * UNITS.get(unit, 1)


def flags_of(args: list[str]) -> dict[str, str]:
    return dict(zip(args, args[1:], strict=False))


def gateway(docs) -> dict:
    return by_kind(docs, "Deployment")["kdamesh-gateway"]


def test_the_gateway_resolves_every_pod_of_each_headless_pool(rendered):
    _, docs = rendered
    services, configmaps = by_kind(docs, "Service"), by_kind(docs, "ConfigMap")
    flags = flags_of(expanded_args(pod_spec(gateway(docs))["containers"][0], configmaps))
    for role, flag in (("decode", "--decode-addresses"), ("prefill", "--prefill-addresses")):
        service = services[f"kdamesh-{role}"]
        assert service["spec"]["clusterIP"] == "None", f"kdamesh-{role} must be headless (one record per pod)"
        assert service["spec"].get("publishNotReadyAddresses", False) is False  # only pods whose model is loaded
        (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert port == GRPC_PORTS[role]
        assert pool_target((flags[flag],), flag) == DnsTarget(f"kdamesh-{role}", port), flags[flag]


def _salt_refs(docs) -> list:
    """What each container of each Deployment sets KDAMESH_CACHE_SALT_SECRET from (name -> list of sources)."""
    refs = {}
    for name, deployment in by_kind(docs, "Deployment").items():
        for c in pod_spec(deployment)["containers"]:
            refs[f"{name}/{c['name']}"] = [e.get("valueFrom", {"value": e.get("value")})
                                           for e in c.get("env", []) if e["name"] == SALT]
    return refs


def test_every_gateway_replica_reads_one_shared_salt_secret(rendered):
    _, docs = rendered
    assert gateway(docs)["spec"]["replicas"] >= 2  # the replicas this is about
    expected = {"secretKeyRef": {"name": "kdamesh-cache-salt", "key": "secret", "optional": False}}
    refs = _salt_refs(docs)
    assert refs.pop("kdamesh-gateway/gateway") == [expected]  # one pod template: the same Secret in every replica
    assert all(v == [] for v in refs.values()), f"only the gateway derives salts: {refs}"
    assert all(SALT not in cm.get("data", {}) for cm in by_kind(docs, "ConfigMap").values())
    secret = expected["secretKeyRef"]["name"]
    mesh = [e for e in pod_spec(gateway(docs))["containers"][0]["env"] if e["name"] == "KDAMESH_MESH_TOKEN"]
    assert mesh[0]["valueFrom"]["secretKeyRef"]["name"] != secret  # two secrets, two purposes
    literal = copy.deepcopy(list(docs))  # negative control: a literal value is caught
    env = pod_spec(gateway(literal))["containers"][0]["env"]
    env[[e["name"] for e in env].index(SALT)] = {"name": SALT, "value": "x" * 32}
    assert _salt_refs(literal)["kdamesh-gateway/gateway"] != [expected]


def _pool_size(docs, name: str) -> int:
    hpa = by_kind(docs, "HorizontalPodAutoscaler").get(name)
    return hpa["spec"]["minReplicas"] if hpa else by_kind(docs, "Deployment")[name]["spec"].get("replicas", 1)


def test_prefill_is_a_pool_and_budgets_keep_every_pool_serving(rendered):
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    assert _pool_size(docs, "kdamesh-prefill") >= 2 and "replicas" not in deployments["kdamesh-prefill"]["spec"]
    for name, budget in by_kind(docs, "PodDisruptionBudget").items():
        targets = [d for n, d in deployments.items()
                   if selects(budget["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"PodDisruptionBudget {name} selects {len(targets)} Deployments"
        size = _pool_size(docs, targets[0]["metadata"]["name"])
        spec = budget["spec"]
        kept = spec["minAvailable"] if "minAvailable" in spec else size - spec["maxUnavailable"]
        assert kept >= (1 if size >= 2 else 0) and (size == 1 or kept >= 1), f"{name} lets the pool go empty"
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a stuck pod never blocks a node drain


def _adapter_rules() -> dict[str, dict]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}


def test_queue_autoscaling_reads_metrics_the_shipped_adapter_rules_make():
    rules = _adapter_rules()
    for metric, rule in rules.items():
        series = re.match(r"'?([a-z_:]+)\{", rule["seriesQuery"])[1]
        assert series in ENGINE_SERIES, f"{metric}: the workers export no {series}"
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), series)
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # a per-pod metric
    hpas = by_kind(kustomize("deploy/k8s/overlays/gpu-k3"), "HorizontalPodAutoscaler")
    assert set(hpas) == {"kdamesh-prefill", "kdamesh-decode"}
    for name, hpa in hpas.items():
        names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert sorted(names) == sorted(rules), f"{name} must scale on {sorted(rules)}, got {names}"


K3_PLAN = PlanArgs(tensor_parallel_size=8, enable_expert_parallel=True, gpus=8, gpu_memory=288 * 10**9,
                   context_len=32768)


@pytest.fixture(scope="module")
def k3():
    docs = kustomize("deploy/k8s/overlays/gpu-k3")
    (configmap,) = by_kind(docs, "ConfigMap").values()
    config = load_model_config(str(ROOT / "engine" / "plan_configs" / "kimi-k3"))
    sized = plan(config, K3_PLAN)
    return docs, configmap["data"], sized, plan(config, PlanArgs(**{**vars(K3_PLAN), "context_len": 131072}))


def test_the_k3_overlay_gives_each_worker_pod_what_the_planner_says(k3):
    docs, settings, sized, _ = k3
    assert sized.fits and settings["KDAMESH_TENSOR_PARALLEL_SIZE"] == "8"
    kv_budget, seqs = parse_bytes(settings["KDAMESH_KV_CACHE_MEMORY"]), int(settings["KDAMESH_MAX_NUM_SEQS"])
    assert seqs * sized.request_bytes <= kv_budget <= sized.usable_bytes  # the sequences fit the per-rank budget
    assert seqs <= sized.concurrency
    for role in ("prefill", "decode"):
        deployment = by_kind(docs, "Deployment")[f"kdamesh-{role}"]
        spec = pod_spec(deployment)
        main = spec["containers"][0]
        assert main["resources"]["requests"][GPU] == main["resources"]["limits"][GPU] == "8"
        assert flags_of(expanded_args(main, by_kind(docs, "ConfigMap")))["--tensor-parallel-size"] == "8"
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and quantity(shm["emptyDir"]["sizeLimit"]) >= 32 * 2**30
        assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
        assert quantity(main["resources"]["limits"]["memory"]) > quantity(shm["emptyDir"]["sizeLimit"])
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert env["NCCL_P2P_LEVEL"] == "NVL" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert not spec.get("initContainers") and settings["KDAMESH_MODEL"] == "/models/Kimi-K3"
    (pvc,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert quantity(pvc["spec"]["resources"]["requests"]["storage"]) >= 8 * sized.weights.total


def test_the_k3_overlay_sizes_redis_and_the_cache_for_its_handoffs(k3):
    docs, settings, sized, long_context = k3
    assert parse_bytes(settings["KDAMESH_MAX_OBJECT_BYTES"]) >= long_context.handoff_bytes  # a 128K handoff
    redis = pod_spec(by_kind(docs, "Deployment")["kdamesh-redis"])["containers"][0]
    flags = flags_of(redis["args"])
    maxmemory = quantity(flags["--maxmemory"])
    assert maxmemory >= 48 * sized.handoff_bytes  # 48 handoffs of 32K in flight, with room for prefix blocks
    assert quantity(redis["resources"]["limits"]["memory"]) > maxmemory
    assert quantity(flags["--client-query-buffer-limit"]) > 2**30  # one MSET of a large object
