"""Every `kdamesh` command line in the compose file and the rendered manifests uses only flags that the `kdamesh`
command line lists in its --help, and parses with the command line's own parsers (the top-level one for
`make-checkpoint`, `deploy.serve.role_parser(role)` for `serve --role ROLE`)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from functools import cache

import pytest

from deploy import cli
from deploy.serve import role_parser
from tests.unit.deploy.deploy_files import ROLES, kdamesh_commands_compose, kdamesh_commands_k8s, run


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
    assert re.search(r"\bserve\b", top_help), f"`kdamesh --help` lists no serve subcommand:\n{top_help}"
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
    parse = (lambda: cli.build_parser().parse_args(argv)) if sub[0] == "make-checkpoint" else \
        (lambda: role_parser(part).parse_args(rest))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parse()
    except SystemExit:
        pytest.fail(f"{where}: `kdamesh {' '.join(argv)}` does not parse:\n{errors.getvalue()}")


def test_k8s_commands_use_only_flags_kdamesh_accepts(rendered):
    rendering, docs = rendered
    commands = kdamesh_commands_k8s(docs)
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


def test_the_check_catches_unknown_flags_and_bad_values():
    """Negative control: the real parsers are consulted, so the passes above mean something."""
    with pytest.raises(AssertionError, match="lists no"):
        check_command("synthetic", ["serve", "--role", "decode", "--model", "m", "--no-such-flag"])
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        check_command("synthetic", ["serve", "--role", "cache", "--byte-budget", "lots"])
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        check_command("synthetic", ["serve", "--role", "gateway", "--model", "m"])  # --decode-workers is required


def test_the_launcher_gives_every_service_one_mesh_token():
    from deploy.launcher import Service, give_mesh_token

    services = [Service("cache", "a", []), Service("gateway", "b", [], env={"KDAMESH_API_KEYS": "k=t"})]
    give_mesh_token(services, "launch-token-0123456789")
    assert [s.env["KDAMESH_MESH_TOKEN"] for s in services] == ["launch-token-0123456789"] * 2
    assert services[1].env["KDAMESH_API_KEYS"] == "k=t"
