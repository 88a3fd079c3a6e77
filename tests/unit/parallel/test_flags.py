"""The tensor/expert-parallel flags reach the engine: `kdamesh serve --role prefill|decode`, `kdamesh up` (the
workers' command lines) and `kdamesh plan`."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser, main
from deploy.launcher import LaunchConfig, plan_services
from deploy.serve import engine_args_from, role_parser
from engine.config import EngineArgs
from engine.model.checkpoint import make_checkpoint


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_flags_set_the_engine_args(role):
    base = ["--model", "m", "--cache-address", "127.0.0.1:1"]
    ns = role_parser(role).parse_args(base + ["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    args = engine_args_from(ns)
    assert args.tensor_parallel_size == 2 and args.enable_expert_parallel
    default = engine_args_from(role_parser(role).parse_args(base))
    assert default.tensor_parallel_size == 1 and not default.enable_expert_parallel


def test_up_passes_them_to_both_workers():
    ns = build_parser().parse_args(["up", "-tp", "2", "--enable-expert-parallel"])
    assert ns.tensor_parallel_size == 2 and ns.enable_expert_parallel
    config = LaunchConfig(engine=EngineArgs(model="", tensor_parallel_size=2, enable_expert_parallel=True))
    for worker in plan_services(config, "m")[1:-1]:
        argv = worker.argv
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "--enable-expert-parallel" in argv
    assert all("--tensor-parallel-size" not in s.argv for s in plan_services(LaunchConfig(), "m"))


def test_plan_subcommand(tmp_path, capsys):
    folder = make_checkpoint("tiny-k3", tmp_path / "tiny-k3", seed=1)
    assert main(["plan", str(folder), "-tp", "2"]) == 0
    assert "tensor-parallel 2" in capsys.readouterr().out
