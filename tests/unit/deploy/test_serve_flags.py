"""`kdamesh serve MODEL` / `kdamesh up`: the `vllm serve` flags that apply are accepted and reach the launcher's
config; a flag whose feature is not built yet (or a combination with two meanings) is refused with its name (never silently accepted), by `up`,
`serve MODEL` and the worker roles alike; `kdamesh serve --help` exits 0; an unknown flag gets argparse's error."""

from __future__ import annotations

import contextlib
import io

import pytest

from deploy import cli
from deploy.mesh_plan import add_mesh_flags, launch_config_from
from deploy.launcher import busy_ports, free_port, plan_services
from deploy.serve import role_parser

SEED = ["--tensor-parallel-size", "1", "--trust-remote-code", "--load-format", "fastsafetensors",
        "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3",
        "--reasoning-parser", "kimi_k3", "--port", "8123"]
REFUSED = {"--tensor-parallel-size": ["--tensor-parallel-size", "0"],
           "--speculative-config": ["--speculative-config", '{"method": "mtp"}'],
           "--kv-cache-dtype": ["--kv-cache-dtype", "fp8_e5m2"],  # fp8 / fp8_e4m3 are built (test below)
           "--gpu-memory-utilization": ["--gpu-memory-utilization", "0.9", "--kv-cache-memory", "1GiB"],  # both
           "--cpu-memory": ["--cpu-memory", "4GiB"]}  # without the fraction it is a fraction of


def _main(argv: list[str]) -> tuple[int, str, str]:
    """`kdamesh ARGV` up to argparse's exit: (exit code, stdout, stderr). Nothing may start."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code, out.getvalue(), err.getvalue()


def _mesh(argv: list[str]):
    parser = cli.argparse.ArgumentParser()
    add_mesh_flags(parser, model_positional=True)
    return parser.parse_args(argv)


def test_serve_help_exits_0_and_lists_the_vllm_flags():
    code, out, _ = _main(["serve", "--help"])
    assert code == 0
    for flag in ("--tensor-parallel-size", "--load-format", "--enable-prefix-caching", "--tool-call-parser",
                 "--api-key", "--served-model-name", "--no-restart", "--uvicorn-log-level", "--port"):
        assert flag in out
    assert _main(["serve", "--role", "gateway", "--help"])[0] == 0  # the container form stays


@pytest.mark.parametrize("flag", sorted(REFUSED))
@pytest.mark.parametrize("head", [["serve", "/m"], ["up", "--model", "/m"]])
def test_an_unbuilt_feature_is_refused_naming_its_flag(head, flag):
    code, _, err = _main([*head, *REFUSED[flag]])
    assert code == 2 and flag in err


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_the_worker_roles_refuse_the_same_flags(flag, monkeypatch):
    monkeypatch.setattr("deploy.serve._serve_worker", lambda *a: pytest.fail("a refused flag must not start"))
    for role, extra in (("prefill", ["--cache-address", "h:1"]), ("decode", [])):
        code, _, err = _main(["serve", "--role", role, "--model", "/m", *extra, *REFUSED[flag]])
        assert code == 2 and flag in err


def test_tensor_and_expert_parallelism_reach_the_launch_config(tmp_path):  # built now: no longer refused
    config = launch_config_from(_mesh([str(tmp_path), "--tensor-parallel-size", "2", "--enable-expert-parallel"]),
                                "info", "text", "none")
    assert (config.engine.tensor_parallel_size, config.engine.enable_expert_parallel) == (2, True)


def test_an_unknown_flag_gets_argparses_error():
    code, _, err = _main(["serve", "/m", "--no-such-flag"])
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err
    assert _main(["up", "--no-such-flag"])[0] == 2


def test_the_seed_command_reaches_the_launch_config(tmp_path):
    ns = _mesh([str(tmp_path), *SEED, "--api-key", "sk-1", "--served-model-name", "k3", "--max-model-len", "4096",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--dtype", "float32", "--seed", "7",
                "--disable-log-requests", "--uvicorn-log-level", "warning", "--no-restart"])
    config = launch_config_from(ns, "info", "text", "none")
    assert (config.model, config.http_port, config.engine.load_format, config.engine.enable_prefix_caching) == \
           (str(tmp_path), 8123, "fastsafetensors", True)
    assert (config.tool_call_parser, config.reasoning_parser, config.enable_auto_tool_choice) == \
           ("kimi_k3", "kimi_k3", True)
    assert (config.api_keys, config.engine.max_model_len, config.engine.seed) == ("sk-1=default", 4096, 7)
    assert config.gateway.served_model_name == config.prefill.served_model_name == config.decode.served_model_name \
        == "k3"
    assert not config.restart and config.gateway.disable_log_requests and config.gateway.uvicorn_log_level == "warning"
    assert not _mesh([str(tmp_path), "--no-enable-prefix-caching"]).enable_prefix_caching

    services = {s.role: s for s in plan_services(config, str(tmp_path))}
    for role in ("prefill", "decode"):
        argv = services[role].argv
        assert argv[argv.index("--load-format") + 1] == "fastsafetensors" and "--seed" in argv
        role_parser(role).parse_args(argv)  # every flag the launcher passes parses
    gateway = services["gateway"].argv
    assert "--disable-log-requests" in gateway and gateway[gateway.index("--uvicorn-log-level") + 1] == "warning"
    role_parser("gateway").parse_args([*gateway, "--enable-prefix-caching", "--trust-remote-code"])
    assert services["gateway"].env == {"KDAMESH_API_KEYS": "sk-1=default"}


def test_snapshot_flags_reach_both_workers(tmp_path):
    ns = _mesh([str(tmp_path), "--snapshot-interval", "256", "--snapshot-budget", "2GiB", "--snapshot-policy",
                "periodic"])
    services = {s.role: s for s in plan_services(launch_config_from(ns, "info", "text", "none"), str(tmp_path))}
    for role in ("prefill", "decode"):
        argv = services[role].argv
        assert [argv[argv.index(f) + 1] for f in ("--snapshot-interval", "--snapshot-budget", "--snapshot-policy")] \
            == ["256", "2GiB", "periodic"]
    assert "--snapshot-budget" not in services["gateway"].argv
    unset = {s.role: s for s in plan_services(launch_config_from(_mesh([str(tmp_path)]), "info", "text", "none"),
                                              str(tmp_path))}
    assert not any(a.startswith("--snapshot") for a in unset["decode"].argv)


def test_fp8_kv_cache_reaches_both_workers(tmp_path):
    ns = _mesh([str(tmp_path), "--kv-cache-dtype", "fp8"])
    config = launch_config_from(ns, "info", "text", "none")
    assert config.engine.kv_cache_dtype == "fp8"
    services = {s.role: s for s in plan_services(config, str(tmp_path))}
    for role in ("prefill", "decode"):
        argv = services[role].argv
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
        assert role_parser(role).parse_args(argv).kv_cache_dtype == "fp8"


def test_busy_ports_names_a_port_something_listens_on():
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        free = free_port()
        assert busy_ports("127.0.0.1", [free, taken]) == [taken]


def test_image_url_flags_reach_the_gateway_config(tmp_path):
    from deploy.serve import gateway_config_from

    ns = _mesh([str(tmp_path), "--allowed-media-domains", "img.example.com", "127.0.0.1",
                "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout-s", "2.5"])
    services = {s.role: s for s in plan_services(launch_config_from(ns, "info", "text", "none"), str(tmp_path))}
    gateway = gateway_config_from(role_parser("gateway").parse_args(services["gateway"].argv))
    fetch = gateway.media_fetch()
    assert (fetch.allowed_domains, fetch.local_root, fetch.timeout_s) == \
           (("img.example.com", "127.0.0.1"), tmp_path.resolve(), 2.5)
    unset = {s.role: s for s in plan_services(launch_config_from(_mesh([str(tmp_path)]), "info", "text", "none"),
                                              str(tmp_path))}
    off = gateway_config_from(role_parser("gateway").parse_args(unset["gateway"].argv)).media_fetch()
    assert (off.allowed_domains, off.local_root) == ((), None)  # the default: only data: URLs


@pytest.mark.parametrize("bad", [["--allowed-local-media-path", "/no/such/dir"],
                                 ["--allowed-media-domains", "https://img.example.com"]])
def test_a_bad_image_url_flag_is_refused_naming_it(bad, monkeypatch):
    monkeypatch.setattr("gateway.app.serve", lambda *a, **k: pytest.fail("a refused flag must not start"))
    for head in (["serve", "/m"], ["up", "--model", "/m"], ["serve", "--role", "gateway", "--model", "/m",
                                                              "--decode-addresses", "h:1", "--mode", "colocated"]):
        code, _, err = _main([*head, *bad])
        assert code == 2 and bad[0] in err, (head, err)


def test_a_speculative_config_reaches_both_workers():
    from deploy.serve import engine_args_from
    from engine.spec.config import SpeculativeConfig

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    config = launch_config_from(_mesh(["/m", "--speculative-config", spec]), "info", "text", None)
    assert config.engine.speculative_config == SpeculativeConfig.parse(spec)
    for service in plan_services(config, "/m")[1:-1]:
        ns = role_parser(service.role).parse_args(service.argv)
        assert engine_args_from(ns).speculative_config == SpeculativeConfig.parse(spec)
    ns = role_parser("decode").parse_args(["--model", "/m", "--speculative-config", spec])
    assert engine_args_from(ns).speculative_config.num_speculative_tokens == 3


def test_the_endpoints_name_the_served_model_and_the_cache_backend(tmp_path, capsys):
    from deploy.launcher import _print_endpoints

    config = launch_config_from(_mesh([str(tmp_path), "--served-model-name", "k3"]), "info", "text", "none")
    _print_endpoints(config, str(tmp_path), plan_services(config, str(tmp_path)))
    out = capsys.readouterr().out
    assert "mesh serving k3 (" in out and "(backend memory;" in out


def test_gpu_memory_utilization_reaches_the_workers_and_the_early_check(tmp_path):
    """Built now: the fraction goes to both workers' EngineArgs; the launcher's early check cannot plan pools it
    has not profiled, so it checks only the context bound (a --max-model-len over the model's limit is refused)."""
    from deploy.checkpoints import resolve_model
    from deploy.launcher import engine_max_model_len
    from engine.model.config import load_model_config

    model = str(resolve_model("demo-k3"))
    config = launch_config_from(_mesh([model, "--gpu-memory-utilization", "0.5", "--cpu-memory", "8GiB"]),
                                "info", "text", "none")
    assert (config.engine.gpu_memory_utilization, config.engine.cpu_memory) == (0.5, "8GiB")  # bytes as typed
    limit = load_model_config(model).max_position_embeddings
    assert engine_max_model_len(config, model) == limit
    bounded = launch_config_from(_mesh([model, "--gpu-memory-utilization", "0.5", "--max-model-len", "4096"]),
                                 "info", "text", "none")
    assert engine_max_model_len(bounded, model) == 4096
    over = launch_config_from(_mesh([model, "--gpu-memory-utilization", "0.5", "--max-model-len",
                                     str(limit + 1)]), "info", "text", "none")
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        engine_max_model_len(over, model)
