"""Fixtures shared by the cache store tests."""

import pytest

from tests.fake_clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
