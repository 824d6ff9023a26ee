"""Fixtures of the `fmserve top` tests: the anyio backend Textual needs, a publisher per test."""

import pytest

from tests.tui.helpers import Publisher


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


@pytest.fixture
def pub():
    p = Publisher()
    yield p
    p.close()
