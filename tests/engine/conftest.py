"""Fixtures of the engine tests."""

import pytest

from tests.engine.helpers import tp_engine


@pytest.fixture
def closing():
    """Tensor-parallel engines (helpers.tp_engine) made through it are closed at the end of the test, whatever
    happens: only one tensor-parallel engine may run per process at a time."""
    made = []

    def make(*args, **kw):
        llm = tp_engine(*args, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.close()
