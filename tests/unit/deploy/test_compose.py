"""The Compose files (deploy/docker-compose*.yml) and the OpenTelemetry collector's configuration, validated offline
(tests/unit/deploy/deploy_files.py): the Compose Specification's schema, `docker-compose config`, health checks,
volumes, addresses that resolve to a service's port, tracing wired to the collector and Jaeger."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.deploy_files import (COMPOSE, COMPOSE_GPU, DEPLOY, GRPC_PORTS, ROLES, compose_config,
                                            compose_errors)


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


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_compose_pools_override_gives_the_gateway_every_worker(gpu):
    services = compose_config(gpu, pools=True)["services"]
    assert {"prefill", "prefill-2", "decode", "decode-2"} <= set(services)
    listening = {}
    for name in ("prefill", "prefill-2", "decode", "decode-2"):
        service = services[name]
        command = service["command"]
        listening[name] = int(command[command.index("--address") + 1].rsplit(":", 1)[1])
        assert service["healthcheck"]["test"][0] == "CMD" and service["volumes"], name
        assert service["depends_on"]["cache"]["condition"] == "service_healthy"
        assert service["environment"]["KDAMESH_MESH_TOKEN"], name
        if gpu:
            (device,) = service["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia", name
    gateway = services["gateway"]
    flags = dict(zip(gateway["command"], gateway["command"][1:], strict=False))
    for flag, pool in (("--decode-addresses", ("decode", "decode-2")), ("--prefill-addresses", ("prefill", "prefill-2"))):
        addresses = flags[flag].split(",")
        assert [a.rsplit(":", 1)[0] for a in addresses] == list(pool)
        assert all(listening[a.rsplit(":", 1)[0]] == int(a.rsplit(":", 1)[1]) for a in addresses)
    assert {gateway["depends_on"][r]["condition"] for r in ("prefill", "prefill-2", "decode", "decode-2")} == \
        {"service_healthy"}
    assert "KDAMESH_CACHE_SALT_SECRET" in gateway["environment"]
