"""Fixtures of the serving benchmark's tests."""

import pytest

from tests.unit.bench import timelines


@pytest.fixture
def timeline():
    return timelines.timeline()
