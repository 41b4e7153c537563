"""The provider contract harness: what a provider implementation supplies to run the shared contract
suite (test_contract.py) against itself.

How to plug a provider in: add a module `tests/providers/subject_<name>.py` holding

    @contextlib.asynccontextmanager
    async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]: ...

conftest.py finds every `subject_*.py` and runs each contract test once per module, with the test id
`[<name>]`. The context manager starts whatever real backend the provider needs (moto, kmock, a work
dir), yields a `ContractSubject` and stops everything on exit. Session fixtures such as
`moto_endpoint_url` are reached with `request.getfixturevalue(...)` (synchronous fixtures only).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import pytest

from kvgate.providers.base import NodeClaim, Provider, ProviderError


@dataclass
class ContractSubject:
    """One provider under test.

    - `provider` and `other_cluster`: two providers of the same pool on the same backing world (one
      moto server, one work dir, one FakeCloud), for two different cluster names.
    - `new_claim()`: a fresh, ready-to-use claim for `provider` (a new id each call) of an offering the
      pool sells and that is in stock; its nodes must be usable by start_replica-free checks at once
      (PENDING is fine).
    - `exhaust()`: arranges that creating the claim it returns fails with a capacity or quota error,
      and returns (that claim, the expected ProviderError subclass), e.g. a stockout -> InsufficientCapacity,
      slots full -> QuotaExceeded.
    - `flags_stockouts`: True when, after `exhaust()` with InsufficientCapacity, `offerings()` shows the
      claim's offering with available=False (a fake can; a real cloud says so only through errors).
    """

    provider: Provider
    other_cluster: Provider
    new_claim: Callable[[], NodeClaim]
    exhaust: Callable[[], Awaitable[tuple[NodeClaim, type[ProviderError]]]]
    flags_stockouts: bool = True


SubjectFactory = Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[ContractSubject]]
