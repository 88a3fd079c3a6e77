"""The H200 overlay (deploy/k8s/overlays/gpu-k3-h200): K3 as TP8 x PP2 over two nodes, one LeaderWorkerSet group
per prefill and decode replica — validated offline (kubectl kustomize, strict schemas; nothing is applied).

- every rendered object but the LeaderWorkerSets passes the strict Kubernetes schema; each LeaderWorkerSet has the
  controller's shape (group size = `--nnodes`, the group restarted as a whole) and its leader and worker pod
  templates pass the strict schema of a `PodTemplate`;
- the leader's `kdamesh serve --role R` and the worker's `kdamesh node` parse with the command line's own parsers,
  with the controller's variables (`LWS_LEADER_ADDRESS`, `LWS_WORKER_INDEX`) as it sets them, and describe the same
  rank group: TP, PP, expert parallelism, model, dtype, device, nodes and rendezvous agree, the leader is node 0, the
  worker node 1, and each pod asks for one GPU per rank it hosts (TP x PP / nodes);
- the Services route to the leaders only (the workers serve no gRPC);
- negative control: a worker whose `--pipeline-parallel-size` differs from its leader's is caught.
"""

from __future__ import annotations

import argparse
import copy

import pytest

from deploy import cli
from deploy.serve import role_parser
from engine.config import EngineArgs
from engine.parallel.node import NODE_OPTIONS
from telemetry.options import add_options
from tests.unit.deploy.deploy_files import by_kind, expanded_args, kustomize, selects, validate_k8s

OVERLAY = "deploy/k8s/overlays/gpu-k3-h200"
LWS_ENV = {"LWS_LEADER_ADDRESS": "kdamesh-decode-0.kdamesh-decode.kdamesh", "LWS_WORKER_INDEX": "1"}
LAYOUT = ("model", "dtype", "device", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
          "nnodes", "master_addr", "master_port")


@pytest.fixture(scope="module")
def docs():
    return kustomize(OVERLAY)


def node_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdamesh node")
    add_options(parser, EngineArgs, only=NODE_OPTIONS)
    return parser


def with_controller_env(container: dict) -> dict:
    """The container as the LeaderWorkerSet controller starts it (it adds the group's variables)."""
    c = copy.deepcopy(container)
    c.setdefault("env", []).extend({"name": k, "value": v} for k, v in LWS_ENV.items())
    return c


def group_commands(lws: dict, configmaps: dict) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(leader's `serve --role` options, worker's `node` options) of a LeaderWorkerSet."""
    template = lws["spec"]["leaderWorkerTemplate"]
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    lead_argv = expanded_args(with_controller_env(leader), configmaps)
    work_argv = expanded_args(with_controller_env(worker), configmaps)
    serve = lead_argv.index("serve")
    assert lead_argv[serve + 1] == "--role"
    lead = role_parser(lead_argv[serve + 2]).parse_args(lead_argv[serve + 3:])
    top, rest = cli.build_parser().parse_known_args(work_argv)  # `kdamesh [global flags] node ...`
    assert top.command == "node", f"the worker runs {work_argv}"
    work = node_parser().parse_args(rest)
    return lead, work


def check_group(lws: dict, configmaps: dict) -> None:
    lead, work = group_commands(lws, configmaps)
    for name in LAYOUT:
        assert getattr(lead, name) == getattr(work, name), f"leader and worker disagree on {name}"
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert lead.nnodes == size and lead.node_rank == 0 and work.node_rank == 1
    assert lead.master_addr == LWS_ENV["LWS_LEADER_ADDRESS"]
    ranks_per_pod = lead.tensor_parallel_size * lead.pipeline_parallel_size // lead.nnodes
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(ranks_per_pod)


def test_objects_pass_the_strict_schemas(docs):
    kinds = {d["kind"] for d in docs}
    assert "LeaderWorkerSet" in kinds
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"} == {"kdamesh-cache", "kdamesh-gateway",
                                                                                 "kdamesh-redis"}
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            continue
        validate_k8s(doc, f"{OVERLAY} {doc['kind']}/{doc['metadata']['name']}")


def test_leaderworkersets_have_the_controllers_shape(docs):
    sets = by_kind(docs, "LeaderWorkerSet")
    assert set(sets) == {"kdamesh-prefill", "kdamesh-decode"}
    for name, lws in sets.items():
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert set(lws["spec"]) <= {"replicas", "startupPolicy", "rolloutStrategy", "leaderWorkerTemplate",
                                    "networkConfig"}
        template = lws["spec"]["leaderWorkerTemplate"]
        assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
        for role in ("leaderTemplate", "workerTemplate"):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": f"{name}-{role}", "namespace": "kdamesh"},
                            "template": template[role]}
            validate_k8s(pod_template, f"{OVERLAY} {name} {role}")


def test_leader_and_worker_form_one_rank_group(docs):
    configmaps = by_kind(docs, "ConfigMap")
    for lws in by_kind(docs, "LeaderWorkerSet").values():
        check_group(lws, configmaps)
    lead, _ = group_commands(by_kind(docs, "LeaderWorkerSet")["kdamesh-decode"], configmaps)
    assert (lead.tensor_parallel_size, lead.pipeline_parallel_size, lead.nnodes) == (8, 2, 2)


def test_services_route_to_the_leaders_only(docs):
    services = by_kind(docs, "Service")
    for name, lws in by_kind(docs, "LeaderWorkerSet").items():
        selector = {"matchLabels": services[name]["spec"]["selector"]}  # a Service selects by labels
        template = lws["spec"]["leaderWorkerTemplate"]
        assert selects(selector, template["leaderTemplate"]["metadata"]["labels"])
        assert not selects(selector, template["workerTemplate"]["metadata"]["labels"])


def test_a_mismatched_worker_is_caught(docs):
    """Negative control: the group check reads both command lines."""
    configmaps = by_kind(docs, "ConfigMap")
    lws = copy.deepcopy(by_kind(docs, "LeaderWorkerSet")["kdamesh-decode"])
    (worker,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    args = worker["args"]
    args[args.index("--pipeline-parallel-size") + 1] = "1"
    with pytest.raises(AssertionError, match="pipeline_parallel_size"):
        check_group(lws, configmaps)
