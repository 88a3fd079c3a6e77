"""The one options tree (telemetry/options.py): `kdamesh up` flags -> `LaunchConfig` -> each role's argv -> that
role's parser -> the very option objects the plan meant; a JSON-valued option round-trips like
`--speculative-config`; a flag is declared once (the drift of defaults is gone); and the launcher's context length
is the workers' own cache plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cache_service.cli import config_from_args
from deploy.cli import build_parser
from deploy.mesh_plan import launch_config_from
from deploy.launcher import LaunchConfig, engine_max_model_len, plan_services
from deploy.serve import gateway_config_from, role_parser, worker_config_from
from telemetry import options
from telemetry.options import add_options, from_namespace, json_option, option, to_argv

UP_FLAGS = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--snapshot-interval", "256", "--snapshot-budget",
            "2GiB", "--snapshot-policy", "periodic", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}', "--no-enable-prefix-caching", "--seed", "7",
            "--served-model-name", "k3", "--no-load-remote-prefix", "--kv-load-failure-policy", "fail",
            "--handoff-full-kv", "--torch-threads", "2", "--cache-backend", "memory", "--cache-byte-budget", "3GiB",
            "--memory-arena", "heap", "--no-data-plane", "--tenant-rpm", "60", "--pd-min-uncached-tokens", "0",
            "--public-docs",
            "--allowed-media-domains", "img.example.com", "--media-fetch-timeout-s", "2.5", "--grace-s", "12",
            "--uvicorn-log-level", "warning", "--tool-call-parser", "kimi_k2", "--reasoning-parser", "none",
            "--no-enable-auto-tool-choice", "--grpc-port", "7000", "--metrics-port", "9100", "--decode-replicas", "2"]


def _parsed(service):
    """The option object `service`'s role builds from its argv."""
    ns = role_parser(service.role).parse_args(service.argv)
    if service.role == "cache":
        return config_from_args(ns)
    if service.role == "gateway":
        return gateway_config_from(ns)
    return worker_config_from(service.role, ns)


def _up(argv: list[str], model: str) -> LaunchConfig:
    config = launch_config_from(build_parser().parse_args(["up", *argv]), "INFO", "text", "none")
    return dataclasses.replace(config, model=model)


def test_up_flags_round_trip_through_every_roles_parser(tmp_path):
    config = _up(UP_FLAGS, str(tmp_path))
    services = plan_services(config, str(tmp_path))
    assert [s.role for s in services] == ["cache", "prefill", "decode", "decode", "gateway"]
    for service in services:
        assert _parsed(service) == service.options, service.name
    cache, prefill, decode, gateway = (services[i].options for i in (0, 1, 2, -1))
    assert (cache.byte_budget, cache.memory_arena, cache.data_plane, cache.shutdown_grace_s) == \
           (3 << 30, "heap", False, 12.0)
    engine = prefill.engine
    assert (engine.kv_cache_memory, engine.max_num_seqs, engine.snapshot_interval, engine.snapshot_budget) == \
           ("64MiB", 4, 256, "2GiB")
    assert engine.speculative_config.num_speculative_tokens == 3 and not engine.enable_prefix_caching
    assert decode.engine == engine and decode.kv_load_failure_policy == "fail" and prefill.handoff_full_kv
    assert not prefill.load_remote_prefix and not decode.load_remote_prefix and decode.torch_threads == 2
    assert (gateway.tenant_rpm, gateway.pd_min_uncached_tokens, gateway.public_docs) == (60, 0, True)
    assert (gateway.tool_call_parser, gateway.reasoning_parser, gateway.enable_auto_tool_choice) == \
           ("kimi_k2", None, False)
    assert gateway.served_model_name == prefill.served_model_name == "k3"
    assert gateway.decode_addresses == ("127.0.0.1:7002", "127.0.0.1:7003")


def test_the_round_trip_can_fail(tmp_path):
    """Negative control: an argv missing one flag, or an object changed after planning, is caught."""
    services = plan_services(_up(UP_FLAGS, str(tmp_path)), str(tmp_path))
    decode = services[2]
    i = decode.argv.index("--snapshot-policy")
    dropped = dataclasses.replace(decode, argv=decode.argv[:i] + decode.argv[i + 2:])
    assert _parsed(dropped) != decode.options
    changed = dataclasses.replace(decode.options, kv_load_failure_policy="recompute")
    assert _parsed(decode) != changed


def test_defaults_are_not_written_and_parse_back_to_defaults(tmp_path):
    services = plan_services(LaunchConfig(), str(tmp_path))
    decode = services[2]
    assert decode.argv[decode.argv.index("--model") + 1] == str(tmp_path)
    assert not any(a.startswith(("--snapshot", "--max-num", "--kv-cache", "--grace")) for a in decode.argv)
    assert all(_parsed(s) == s.options for s in services)


# -- the generator alone -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Compilation:
    level: int = 0
    sizes: tuple[int, ...] = ()

    @classmethod
    def parse(cls, value):
        if value is None or isinstance(value, cls):
            return value
        data = json.loads(value) if isinstance(value, str) else value
        return cls(level=data.get("level", 0), sizes=tuple(data.get("sizes", ())))


@dataclasses.dataclass(frozen=True)
class _Engine:
    """A stand-in for `EngineArgs` with the two options the decode-step work adds: they only need metadata."""

    model: str = option("--model")
    enforce_eager: bool = option("--enforce-eager", default=False, kind="switch")
    compilation_config: _Compilation | dict | str | None = json_option("--compilation-config", help="JSON")

    def __post_init__(self):
        object.__setattr__(self, "compilation_config", _Compilation.parse(self.compilation_config))


def _toy_parser():
    import argparse

    parser = argparse.ArgumentParser()
    add_options(parser, _Engine)
    return parser


def test_a_json_valued_option_round_trips():
    engine = _Engine("m", enforce_eager=True, compilation_config={"level": 3, "sizes": [1, 2, 4]})
    argv = to_argv(engine)
    assert argv[argv.index("--compilation-config") + 1] == json.dumps({"level": 3, "sizes": [1, 2, 4]})
    assert from_namespace(_Engine, _toy_parser().parse_args(argv)) == engine
    plain = _Engine("m")
    assert to_argv(plain) == ["--model", "m"] and from_namespace(_Engine, _toy_parser().parse_args(["--model", "m"])) \
        == plain != engine  # negative control: the options do change the object


def test_two_different_flags_for_one_destination_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Clash:
        model: str = option("--model", default="x", help="another --model")

    parser = _toy_parser()
    with pytest.raises(ValueError, match="both set 'model'"):
        add_options(parser, Clash)


# -- one declaration per flag ------------------------------------------------------------------------------------


# Flags two option classes declare with different meanings on purpose (each is declared once per meaning).
SAME_NAME_OTHER_MEANING = {
    "--model": "up: a folder or a shipped name, optional (demo-k3); the engine and the gateway: the folder, required",
    "--grpc-port": "up: the first of the mesh's consecutive service ports; the gateway: its public gRPC API",
    "--metrics-port": "up: the first of consecutive /metrics ports; a service: its own",
    "--address": "one declaration (address_option); each service listens on its own default port",
    "--max-model-len": "the engine: the context length it plans; the gateway: the length it reports (the launcher "
                       "passes the workers')",
    "--cache-address": "prefill: required; decode and gateway: optional, each with its own use",
    "--tool-call-parser": "up: 'auto' (the model family's) or 'none' too; the gateway: a registered parser",
    "--reasoning-parser": "as --tool-call-parser",
    "--enable-auto-tool-choice": "up: on by default (--no-...); the gateway: off unless given",
}


def _declarations(cls, seen=None) -> dict[str, set]:
    """flag name -> the distinct `Flag` declarations of it in `cls` and its sections."""
    seen = {} if seen is None else seen
    for f in dataclasses.fields(cls):
        if options.FLAG in f.metadata:
            flag = f.metadata[options.FLAG]
            seen.setdefault(flag.names[0], set()).add((flag, repr(f.default)))
        elif options.SECTION in f.metadata:
            _declarations(f.metadata[options.SECTION].cls, seen)
    return seen


def test_each_flag_is_declared_once_with_one_default():
    from cache_service.cli import CacheCliOptions

    seen = _declarations(CacheCliOptions, _declarations(LaunchConfig))
    twice = {name for name, declared in seen.items() if len(declared) > 1}
    assert twice == set(SAME_NAME_OTHER_MEANING)
    for name in ("--grace-s", "--snapshot-interval", "--snapshot-policy", "--served-model-name", "--mode", "--port"):
        assert len(seen[name]) == 1, name
    from engine.memory.policy import SNAPSHOT_POLICIES

    (policy, _), = seen["--snapshot-policy"]
    assert policy.choices == SNAPSHOT_POLICIES


def test_the_declaration_count_sees_a_second_default():
    """Negative control: a second `--grace-s` with another default counts as a second declaration."""

    @dataclasses.dataclass(frozen=True)
    class Drifted:
        grace_s: float = option("--grace-s", default=30.0, parse=float)

    seen = _declarations(Drifted, _declarations(LaunchConfig))
    assert len(seen["--grace-s"]) == 2


# -- the launcher's context length is the workers' plan ---------------------------------------------------------------


def _worker_plan(config: LaunchConfig, model: str) -> int:
    """What a decode worker started by this launch plans: its own parser, its EngineArgs, the engine's plan_cache."""
    from deploy.serve import engine_args_from
    from engine.config import plan_cache
    from engine.model.config import load_model_config
    from engine.model.loader import resolve_dtype

    decode = next(s for s in plan_services(config, model) if s.role == "decode")
    args = engine_args_from(role_parser("decode").parse_args(decode.argv))
    model_config = load_model_config(model)
    return plan_cache(args, model_config, resolve_dtype(args.dtype, args.device, model_config).itemsize).max_model_len


@pytest.mark.parametrize("flags, expected", [
    ([], 138_784),
    (["--snapshot-budget", "128MiB"], 91_680),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'], 72_608),
    (["--tensor-parallel-size", "2"], 147_168)])
def test_engine_max_model_len_is_the_workers_plan(flags, expected):
    from deploy.checkpoints import resolve_model

    model = str(resolve_model("demo-k3"))
    config = _up(["--kv-cache-memory", "256MiB", *flags], model)
    assert engine_max_model_len(config, model) == _worker_plan(config, model) == expected
    if flags:  # negative control: the flag changes the plan, so forgetting it would be seen
        assert expected != _worker_plan(_up(["--kv-cache-memory", "256MiB"], model), model)
