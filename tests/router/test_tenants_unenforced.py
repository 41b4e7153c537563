"""Tenant documents validate but the gateway does not check API keys yet: it must say so, not stay silent."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from tests.gateway_harness import running_gateway

MODEL = """apiVersion: kvgate/v1
kind: Model
metadata: {name: m}
spec:
  source: builtin:tiny-llama
  routing: {static_replicas: [{url: 'http://127.0.0.1:9'}]}
"""
TENANT = """---
apiVersion: kvgate/v1
kind: Tenant
metadata: {name: acme}
spec:
  api_key_sha256: "%s"
  models: ["*"]
""" % ("ab" * 32)


async def test_a_gateway_whose_registry_declares_tenants_warns_that_it_does_not_enforce_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "models.yaml").write_text(MODEL)
    caplog.set_level(logging.WARNING, logger="kvgate.router.app")
    async with running_gateway(tmp_path) as (url, _):
        async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as response:
            assert response.status == 200
        assert "does not check API keys" not in caplog.text  # no tenants, nothing to say
    (tmp_path / "models.yaml").write_text(MODEL + TENANT)
    async with running_gateway(tmp_path):
        assert "declares 1 Tenant(s) (acme), but this gateway does not check API keys" in caplog.text
