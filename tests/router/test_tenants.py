"""API keys and tenants at the gateway: the official openai SDK and raw HTTP -> kvgate router -> sim replicas.

With no Tenant the gateway is open and says so; with tenants, a missing or wrong key gets 401 invalid_api_key,
a tenant sees and uses only its own names (another's is answered as if it did not exist), and the key never
shows in a log line, /metrics or an answer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import aiohttp
import openai
import pytest

from kvgate.registry.tenant import KEY_SECRET_ENV, key_hmac
from kvgate.router.app import GatewaySettings
from kvgate.router.main import main as router_main
from kvgate.stack import main as up_main
from tests.router.sim_gateway import chat, gateway

SECRET = b"test-secret-0123456789-abcdefghijklmnop"
ACME_KEY, GLOBEX_KEY = "kvg_acme-key-for-tests-only", "kvg_globex-key-for-tests-only"
KEYED = GatewaySettings(key_secret=SECRET)


def tenant(name: str, key: str, models: str, secret: bytes = SECRET) -> str:
    return f"""---
apiVersion: kvgate/v1
kind: Tenant
metadata: {{name: {name}}}
spec: {{api_key_hmac: "{key_hmac(secret, key)}", models: {models}}}
"""


def write_tenants(root: Path) -> None:
    """acme may use model m; globex only m's adapter sql (a model does not bring its adapters)."""
    (root / "tenants.yaml").write_text(tenant("acme", ACME_KEY, "[m]") + tenant("globex", GLOBEX_KEY, "[sql]"))


async def get(url: str, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body), headers=headers) as r:
        return r.status, dict(r.headers), await r.text()


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def test_without_tenants_the_gateway_is_open_and_says_so_once_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.router.tenants")
    async with gateway(tmp_path, num_replicas=1) as gw:
        assert (await gw.client.chat.completions.create(**chat("hi"))).choices
        status, _, models = await get(gw.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["cold", "m", "sql"]
    assert caplog.text.count("no Tenant declared: the gateway is open") == 1


async def test_a_missing_or_wrong_key_gets_401_invalid_api_key_counted_in_metrics(tmp_path: Path) -> None:
    write_tenants(tmp_path)
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        answers = [await post(gw.url + "/v1/chat/completions", chat("hi"), headers)
                   for headers in ({}, {"Authorization": "Bearer kvg_wrong"}, {"Authorization": "Basic " + ACME_KEY},
                                   {"Authorization": f"Bearer {ACME_KEY}x"})]
        listing = await get(gw.url + "/v1/models", "kvg_wrong")
        metrics = await metrics_text(gw.url)
        with pytest.raises(openai.AuthenticationError) as caught:  # the SDK's own reading of it
            await gw.client.chat.completions.create(**chat("hi"))  # its api_key is "unused"
    for status, headers, text in answers:
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        error = json.loads(text)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "AuthenticationError"
    assert listing[0] == 401 and listing[2]["error"]["code"] == "invalid_api_key"
    assert caught.value.code == "invalid_api_key"
    assert 'kvgate_router_refused_requests_total{model="_unknown",reason="unauthorized",status="401",tenant="_none"} 5.0' in metrics


async def test_a_tenant_sees_and_uses_only_its_own_models(tmp_path: Path) -> None:
    write_tenants(tmp_path)
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        acme = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ACME_KEY, max_retries=0, timeout=10.0)
        globex = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=GLOBEX_KEY, max_retries=0, timeout=10.0)
        try:
            assert [m.id for m in (await acme.models.list()).data] == ["m"]
            # globex may use the adapter, not its base model: the listing does not name the base.
            assert [(m.id, m.parent) for m in (await globex.models.list()).data] == [("sql", None)]
            assert (await acme.chat.completions.create(**chat("hi"))).choices
            assert (await globex.chat.completions.create(**chat("hi", model="sql"))).choices
            health = await get(gw.url + "/health")
            assert health[0] == 200 and "num_ready" not in health[2] and health[2]["num_ready_total"] == 1
            assert "cold" not in json.dumps(health[2])  # no model's name to an unauthenticated caller
            hidden = await post(gw.url + "/v1/chat/completions", chat("hi", model="sql"),
                                {"Authorization": f"Bearer {ACME_KEY}"})
            unknown = await post(gw.url + "/v1/chat/completions", chat("hi", model="ghos"),
                                 {"Authorization": f"Bearer {ACME_KEY}"})
            with pytest.raises(openai.NotFoundError):
                await globex.chat.completions.create(**chat("hi"))  # m itself is not globex's
        finally:
            await acme.close()
            await globex.close()
    # Another tenant's model is answered exactly as a name that does not exist, listing only acme's own.
    assert hidden[0] == unknown[0] == 404
    assert json.loads(hidden[2]) == json.loads(unknown[2].replace("ghos", "sql"))
    assert "'sql' does not exist; this gateway serves: m" in hidden[2]


async def test_keys_never_appear_in_logs_metrics_or_answers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    write_tenants(tmp_path)
    wrong = "kvg_a-wrong-key-that-must-not-leak"
    seen = []
    async with gateway(tmp_path, num_replicas=1, settings=KEYED) as gw:
        for key in (ACME_KEY, GLOBEX_KEY, wrong):
            for model in ("m", "sql", "ghost"):
                status, headers, text = await post(gw.url + "/v1/chat/completions", chat("hi", model=model),
                                                   {"Authorization": f"Bearer {key}"})
                seen.append(f"{status} {headers} {text}")
            seen.append(str(await get(gw.url + "/v1/models", key)))
        seen.append(await metrics_text(gw.url))
        for path in ("/admin/stats", "/health"):
            seen.append(str(await get(gw.url + path)))
    assert any(s.startswith("200 ") for s in seen) and any(s.startswith("401 ") for s in seen)
    everything = "\n".join(seen) + caplog.text
    for key in (ACME_KEY, GLOBEX_KEY, wrong):
        assert key not in everything and key.removeprefix("kvg_") not in everything


def write_fronting_registry(root: Path) -> None:
    (root / "r.yaml").write_text("""apiVersion: kvgate/v1
kind: Model
metadata: {name: m}
spec:
  source: builtin:tiny-llama
  routing: {static_replicas: [{url: 'http://127.0.0.1:9'}]}
""" + tenant("acme", ACME_KEY, "['*']"))


@pytest.mark.parametrize("main", [router_main, up_main], ids=["router", "up"])
def test_a_gateway_with_tenants_refuses_to_start_without_the_key_secret(
        main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    write_fronting_registry(tmp_path)
    monkeypatch.delenv(KEY_SECRET_ENV, raising=False)
    assert main(["--registry", str(tmp_path), "--port", "9"]) != 0
    assert f"Tenant(s) (acme), whose API keys are checked against HMACs under {KEY_SECRET_ENV}, which is not set" \
        in capsys.readouterr().err
    monkeypatch.setenv(KEY_SECRET_ENV, "short")
    assert main(["--registry", str(tmp_path), "--port", "9"]) != 0
    assert f"{KEY_SECRET_ENV} is 5 characters; use at least 32" in capsys.readouterr().err
