"""The contract subject for AwsProvider: two clusters on one real `moto` server process, boto3 over HTTP.

moto cannot produce capacity errors, so `exhaust()` injects one at the boto3 boundary: a botocore
`before-send` hook answers RunInstances for the exhausted claim with EC2's real error document
(HTTP 500, code InsufficientInstanceCapacity), which botocore parses as it would AWS's answer.
`ErrorInjector` is also used by test_aws.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs

import boto3
import pytest
from botocore.awsrequest import AWSResponse

from kvgate.clock import FakeClock
from kvgate.providers.aws import AwsProvider
from kvgate.providers.base import CapacityType, InsufficientCapacity, NodeClaim, OfferingKey, ProviderError
from kvgate.registry.schema import PoolSpec
from tests.providers.contract import ContractSubject

POOL = "aws-pool"
WHEEL_URL = "https://artifacts.example/kvgate/kvgate-0.1.0-py3-none-any.whl"  # where test nodes get kvgate
REGION = "us-east-1"


class _Raw:
    """The bit of a urllib3 response that botocore's AWSResponse reads: the body as a stream."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, *args: Any, **kwargs: Any):
        yield self._body


def ec2_error(code: str, message: str = "injected by the test", status: int = 500) -> AWSResponse:
    """An HTTP answer shaped like EC2's error document, for a `before-send` hook to return."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code>'
            f'<Message>{message}</Message></Error></Errors><RequestID>test-0000</RequestID></Response>').encode()
    return AWSResponse("https://ec2.test/", status, {"Content-Type": "text/xml"}, _Raw(body))


class ErrorInjector:
    """A botocore `before-send` hook on a boto3 Session: `rules` map an EC2 action to a function of the
    request's form fields that returns an error code to answer with, a whole answer (AWSResponse), or
    None to let the request through to moto. `seen` counts the requests per action the hook looked at.
    Register it before the clients are made (they copy the session's hooks); rules may change later."""

    def __init__(self, session: boto3.Session) -> None:
        self.rules: dict[str, Callable[[dict[str, str]], str | AWSResponse | None]] = {}
        self.seen: dict[str, int] = {}
        session.events.register("before-send.ec2", self._before_send)

    def _before_send(self, request: Any, **kwargs: Any) -> AWSResponse | None:
        body = request.body.decode() if isinstance(request.body, bytes) else (request.body or "")
        fields = {key: values[0] for key, values in parse_qs(body).items()}
        action = fields.get("Action", "")
        self.seen[action] = self.seen.get(action, 0) + 1
        rule = self.rules.get(action)
        answer = rule(fields) if rule else None
        if isinstance(answer, str):
            return ec2_error(answer, status=503 if answer in ("RequestLimitExceeded", "Throttling") else 500)
        return answer


def moto_session() -> boto3.Session:
    """A Session with throwaway credentials that only moto accepts, never real ones."""
    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)


def pool_spec(session: boto3.Session, endpoint_url: str, **extra: Any) -> PoolSpec:
    """A pool with an on-demand and a two-zone spot offer, its AMI registered in moto for the test."""
    image_id = session.client("ec2", endpoint_url=endpoint_url).register_image(
        Name=f"kvgate-test-{uuid.uuid4().hex[:6]}", RootDeviceName="/dev/sda1")["ImageId"]
    return PoolSpec.model_validate({
        "provider": "aws", "region": REGION, "aws": {"endpoint_url": endpoint_url, "image_id": image_id,
                                              "install": {"wheel_url": WHEEL_URL}},
        "offers": [
            {"instance_type": "g5.xlarge", "gpu_kind": "A10G", "gpu_count": 1, "price_usd_per_hour": 1.006},
            {"instance_type": "g5.xlarge", "gpu_kind": "A10G", "gpu_count": 1, "price_usd_per_hour": 0.45,
             "capacity_type": "spot", "zones": ["us-east-1a", "us-east-1b"]},
        ], **extra})


def claim(capacity_type: CapacityType = CapacityType.ON_DEMAND, zone: str = "", model: str = "tiny-llama") -> NodeClaim:
    return NodeClaim(id=f"claim-{uuid.uuid4().hex[:10]}", offering=OfferingKey(POOL, "g5.xlarge", capacity_type, zone),
                     model=model)


async def no_sleep(seconds: float) -> None:
    """Backoff waits are the injected sleep's business; the contract needs none."""


@asynccontextmanager
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]:
    session = moto_session()
    spec = pool_spec(session, request.getfixturevalue("moto_endpoint_url"))
    injector = ErrorInjector(session)
    stocked_out: set[str] = set()
    injector.rules["RunInstances"] = lambda f: "InsufficientInstanceCapacity" if f.get("ClientToken") in stocked_out else None
    clock = FakeClock()
    provider = AwsProvider(POOL, spec, cluster=f"a-{uuid.uuid4().hex[:6]}", clock=clock, session=session, sleep=no_sleep)
    other = AwsProvider(POOL, spec, cluster=f"b-{uuid.uuid4().hex[:6]}", clock=clock, session=session, sleep=no_sleep)

    async def exhaust() -> tuple[NodeClaim, type[ProviderError]]:
        exhausted = claim(CapacityType.SPOT, "us-east-1b")
        stocked_out.add(exhausted.id)
        return exhausted, InsufficientCapacity

    try:
        # EC2 reports a stockout only as an error to a launch, so offerings() cannot flag it beforehand.
        yield ContractSubject(provider=provider, other_cluster=other, new_claim=claim, exhaust=exhaust,
                              flags_stockouts=False)
    finally:
        for each in (provider, other):
            for node in await each.list():
                await each.delete(node.id)
            await each.close()
