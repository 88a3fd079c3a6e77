"""The kustomize renderings as a fixture: each test that takes `rendered` runs once per rendering."""

import pytest

from tests.unit.deploy.deploy_files import RENDERINGS


@pytest.fixture(params=list(RENDERINGS))
def rendered(request) -> tuple[str, tuple[dict, ...]]:
    """(rendering name, the objects `kubectl kustomize` renders for it)."""
    return request.param, RENDERINGS[request.param]()
