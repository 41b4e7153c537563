"""Fixtures of the provider suites. `subject` runs each contract test once per `subject_*.py` module
(see contract.py for how to add a provider)."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.providers.contract import ContractSubject

SUBJECTS = sorted(path.stem.removeprefix("subject_") for path in Path(__file__).parent.glob("subject_*.py"))


@pytest.fixture(params=SUBJECTS)
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]:
    module = importlib.import_module(f"tests.providers.subject_{request.param}")
    async with module.subject(request) as value:
        yield value
