"""`kdamesh up --prefill-replicas N --decode-replicas M`: one process per replica on its own gRPC and metrics ports,
the gateway given every address, the one-replica layout unchanged, bad counts refused; the generated salt secret."""

from __future__ import annotations

import dataclasses

import pytest

from deploy.cli import build_parser
from deploy.mesh_plan import launch_config_from
from deploy.launcher import LaunchConfig, give_salt_secret, plan_services
from gateway.tenancy import SALT_SECRET_ENV


def _flag(service, flag):
    return service.argv[service.argv.index(flag) + 1]


def test_replicas_get_their_own_ports_and_the_gateway_every_address(tmp_path):
    config = LaunchConfig(model=str(tmp_path), grpc_port=7000, metrics_port=9100, prefill_replicas=2,
                          decode_replicas=3)
    services = plan_services(config, str(tmp_path))
    assert [s.name for s in services] == ["cache", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2",
                                          "gateway"]
    workers = services[1:-1]
    assert [s.address for s in workers] == [f"127.0.0.1:{p}" for p in range(7001, 7006)]
    assert [_flag(s, "--metrics-port") for s in services[:-1]] == [str(p) for p in range(9100, 9106)]
    assert all(_flag(s, "--cache-address") == "127.0.0.1:7000" for s in workers)
    gateway = services[-1]
    assert _flag(gateway, "--prefill-addresses") == "127.0.0.1:7001,127.0.0.1:7002"
    assert _flag(gateway, "--decode-addresses") == "127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005"
    assert _flag(gateway, "--grpc-port") == "7006"
    ports = [p for s in services for p in s.ports]
    assert len(ports) == len(set(ports)), "two services share a port"


def test_one_replica_each_keeps_the_layout(tmp_path):
    services = plan_services(LaunchConfig(model=str(tmp_path), grpc_port=7000), str(tmp_path))
    assert [(s.name, s.address) for s in services[:-1]] == [("cache", "127.0.0.1:7000"), ("prefill", "127.0.0.1:7001"),
                                                             ("decode", "127.0.0.1:7002")]
    assert _flag(services[-1], "--grpc-port") == "7003"
    colocated = plan_services(LaunchConfig(model=str(tmp_path), mode="colocated", decode_replicas=2), str(tmp_path))
    assert [s.name for s in colocated] == ["cache", "decode-0", "decode-1", "gateway"]
    assert "--prefill-addresses" not in colocated[-1].argv


def test_bad_replica_counts_are_refused(capsys):
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        LaunchConfig(decode_replicas=0)
    with pytest.raises(ValueError, match="--prefill-replicas needs --mode disaggregated"):
        LaunchConfig(mode="colocated", prefill_replicas=2)
    args = build_parser().parse_args(["up", "--prefill-replicas", "0"])
    assert args.func(args) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err
    ns = build_parser().parse_args(["up", "--prefill-replicas", "2", "--decode-replicas", "2"])
    config = launch_config_from(ns, "INFO", "text", "none")
    assert (config.prefill_replicas, config.decode_replicas) == (2, 2)


def test_the_salt_secret_reaches_the_gateway_only(tmp_path):
    services = plan_services(LaunchConfig(model=str(tmp_path)), str(tmp_path))
    give_salt_secret(services, "s" * 64)
    assert services[-1].env[SALT_SECRET_ENV] == "s" * 64
    assert all(SALT_SECRET_ENV not in (s.env or {}) for s in services[:-1])


def test_remote_prefix_loading_off_reaches_both_roles_and_the_gateway_follows_the_cache(tmp_path):
    """`kdamesh up --no-load-remote-prefix`: every worker gets the flag and its role parser turns it into its
    config; the gateway is always given the cache service's address (whose KV events it follows)."""
    from deploy.serve import gateway_config_from, role_parser

    ns = build_parser().parse_args(["up", "--no-load-remote-prefix", "--decode-replicas", "2"])
    config = launch_config_from(ns, "INFO", "text", "none")
    services = plan_services(dataclasses.replace(config, model=str(tmp_path), grpc_port=7000), str(tmp_path))
    workers = [s for s in services if s.role in ("prefill", "decode")]
    assert len(workers) == 3 and all("--no-load-remote-prefix" in s.argv for s in workers)
    for s in workers:
        assert role_parser(s.role).parse_args(s.argv).load_remote_prefix is False
    default = plan_services(LaunchConfig(model=str(tmp_path), grpc_port=7000), str(tmp_path))
    assert not any("--no-load-remote-prefix" in s.argv for s in default)  # negative control: on by default
    assert all(role_parser(s.role).parse_args(s.argv).load_remote_prefix for s in default[1:-1])
    gateway = services[-1]
    assert _flag(gateway, "--cache-address") == "127.0.0.1:7000"
    assert gateway_config_from(role_parser("gateway").parse_args(gateway.argv)).cache_address == "127.0.0.1:7000"
