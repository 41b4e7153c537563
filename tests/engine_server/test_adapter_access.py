"""The adapter endpoints as admin endpoints: a Bearer token, refused beyond loopback without one, and loads only
from configured roots, with errors that tell nothing of the replica's file system. A real engine
(builtin:tiny-llama) behind the real app on real sockets; FakeLoRA where a test must see the source a load
reached the engine with. The process-level wiring (flags, environment, start-up log) is in test_process.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.server.adapter_access import (ADMIN_TOKEN_ENV, AdapterAccess, access_for, adapter_root,
                                                 allowed_source, startup_notice)
from kvgate.openai_wire import ApiError
from tests.engine.peft_files import write_peft_dir
from tests.engine_server.server_helpers import MODEL, FakeLoRA, make_settings, open_adapters, start_client

TOKEN = "engine-admin-s3cret"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


async def model_ids(client: TestClient) -> list[str]:
    return [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]


# ------------------------------------------------------------------------------------------ token


async def test_with_a_token_both_endpoints_need_it_as_a_bearer_token(engine: AsyncLLM, tmp_path: Path) -> None:
    source = str(write_peft_dir(tmp_path / "sql"))
    client = await start_client(engine, make_settings(adapter_access=open_adapters(tmp_path, token=TOKEN)))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Bearer {TOKEN[:-1]}"}):
            for path, body in ((LOAD, {"lora_name": "sql", "lora_path": source}), (UNLOAD, {"lora_name": "sql"})):
                refused = await client.post(path, json=body, headers=headers)
                error = (await refused.json())["error"]
                assert (refused.status, error["type"], error["code"]) == (401, "AuthenticationError",
                                                                          "invalid_admin_token")
                assert refused.headers["WWW-Authenticate"] == "Bearer" and TOKEN not in await refused.text()
        assert await model_ids(client) == [MODEL]
        granted = {"Authorization": f"Bearer {TOKEN}"}
        loaded = await client.post(LOAD, json={"lora_name": "sql", "lora_path": source}, headers=granted)
        assert loaded.status == 200 and await model_ids(client) == [MODEL, "sql"]
        assert (await client.post(UNLOAD, json={"lora_name": "sql"}, headers=granted)).status == 200
    finally:
        await client.close()


async def test_without_a_token_beyond_loopback_both_endpoints_are_refused_saying_how_to_open_them(
        engine: AsyncLLM, tmp_path: Path) -> None:
    access = access_for(host="0.0.0.0", environ={}, insecure_open=False, roots=(adapter_root(str(tmp_path)),),
                        startup_sources=())
    client = await start_client(engine, make_settings(adapter_access=access))
    try:
        body = {"lora_name": "sql", "lora_path": str(write_peft_dir(tmp_path / "sql"))}
        for path in (LOAD, UNLOAD):
            refused = await client.post(path, json=body)
            error = (await refused.json())["error"]
            assert (refused.status, error["type"], error["code"]) == (403, "PermissionDeniedError",
                                                                      "adapter_endpoints_disabled")
            assert ADMIN_TOKEN_ENV in error["message"] and "--insecure-open-adapters" in error["message"]
        assert await model_ids(client) == [MODEL]
    finally:
        await client.close()


@pytest.mark.parametrize("host, environ, insecure_open, opened", [
    ("127.0.0.1", {}, False, True),  # the single box (kvgate up's replicas): open as before
    ("::1", {}, False, True),
    ("localhost", {}, False, True),
    ("0.0.0.0", {}, False, False),  # beyond loopback without a token: off
    ("10.0.0.5", {ADMIN_TOKEN_ENV: ""}, False, False),  # an empty token is no token
    ("0.0.0.0", {}, True, True),  # ... unless the operator says so
])
def test_the_endpoints_open_without_a_token_only_on_loopback_or_when_told(
        host: str, environ: dict[str, str], insecure_open: bool, opened: bool) -> None:
    access = access_for(host=host, environ=environ, insecure_open=insecure_open, roots=(), startup_sources=())
    assert (access.token, access.open_without_token) == (None, opened)


def test_opening_the_endpoints_beyond_loopback_is_said_as_a_warning_and_the_token_never() -> None:
    opened = access_for(host="0.0.0.0", environ={}, insecure_open=True, roots=(), startup_sources=())
    level, message = startup_notice(opened, host="0.0.0.0", insecure_open=True)
    assert level == logging.WARNING and "OPEN" in message
    guarded = access_for(host="0.0.0.0", environ={ADMIN_TOKEN_ENV: TOKEN}, insecure_open=False, roots=(),
                         startup_sources=())
    level, message = startup_notice(guarded, host="0.0.0.0", insecure_open=False)
    assert level == logging.INFO and TOKEN not in message and TOKEN not in repr(guarded)
    assert startup_notice(open_adapters(), host="127.0.0.1", insecure_open=False) is None


# ------------------------------------------------------------------------------------------ roots


async def test_a_path_under_no_root_gets_one_403_whether_or_not_it_exists(engine: AsyncLLM, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = write_peft_dir(tmp_path / "outside")  # a valid adapter, but not under the root
    (root / "link").symlink_to(outside)
    (tmp_path / "rootsibling").mkdir()
    client = await start_client(engine, make_settings(adapter_access=open_adapters(root, "s3://adapters/team-a")))
    try:
        answers = []
        for path in (str(outside), str(tmp_path / "missing"), f"{root}/../outside", str(root / "link"),
                     str(tmp_path / "rootsibling"), "/etc", "/", "relative/dir", "~", "s3://adapters/team-b/x",
                     "s3://adapters/team-a/../team-b", "s3://other/team-a", "http://example.com/a", "a\0b"):
            response = await client.post(LOAD, json={"lora_name": "sql", "lora_path": path})
            answers.append((response.status, await response.json()))
        (status, body), = {(s, repr(b)) for s, b in answers}  # every refusal is the same answer
        error = answers[0][1]["error"]
        assert (status, error["param"], error["code"]) == (403, "lora_path", "adapter_source_not_allowed")
        assert str(tmp_path) not in body and await model_ids(client) == [MODEL]
    finally:
        await client.close()


async def test_an_allowed_path_that_holds_no_adapter_gets_one_400_naming_the_adapter_not_the_path(
        engine: AsyncLLM, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "empty").mkdir(parents=True)
    (root / "file").write_text("not an adapter")
    write_peft_dir(root / "wrong-rank", rank=64)  # above max_lora_rank
    (root / "bad").mkdir()
    (root / "bad" / "adapter_config.json").write_text("{ not json")
    client = await start_client(engine, make_settings(adapter_access=open_adapters(root)))
    try:
        bodies = set()
        for path in ("missing", "empty", "file", "wrong-rank", "bad", "x" * 300):  # 300: a name the OS refuses
            response = await client.post(LOAD, json={"lora_name": "sql", "lora_path": str(root / path)})
            error = (await response.json())["error"]
            assert (response.status, error["param"], error["code"]) == (400, "lora_path", "adapter_load_failed")
            bodies.add(await response.text())
        [body] = bodies
        assert "'sql'" in body and str(tmp_path) not in body and "adapter_config" not in body
        assert await model_ids(client) == [MODEL]
    finally:
        await client.close()


async def test_a_local_source_is_loaded_from_its_resolved_path_and_builtins_need_no_root(
        engine: AsyncLLM, tmp_path: Path) -> None:
    root = tmp_path / "root"
    target = write_peft_dir(root / "v2")
    (root / "current").symlink_to(target)  # a symlink that stays under the root is fine
    fake = FakeLoRA(engine)
    client = await start_client(fake, make_settings(adapter_access=open_adapters(root)))
    try:
        for name, path in (("sql", str(root / "current")), ("sql2", f"{root}/v2/../current"),
                           ("demo", "builtin:smollm2-demo-a")):
            response = await client.post(LOAD, json={"lora_name": name, "lora_path": path})
            assert response.status == 200, await response.text()
        assert fake.sources == {"sql": os.path.realpath(target), "sql2": os.path.realpath(target),
                                "demo": "builtin:smollm2-demo-a"}
    finally:
        await client.close()


def test_a_source_the_engine_was_started_with_may_be_loaded_again_without_a_root(tmp_path: Path) -> None:
    access = AdapterAccess(open_without_token=True, startup_sources=frozenset({"/srv/sql", "s3://b/sql"}))
    assert allowed_source(access, "/srv/sql") == "/srv/sql" and allowed_source(access, "s3://b/sql") == "s3://b/sql"
    with pytest.raises(ApiError) as refused:
        allowed_source(access, "/srv/sql/../other")
    assert refused.value.status == 403


@pytest.mark.parametrize("root, source, allowed", [
    ("s3://adapters", "s3://adapters/team-a/sql", True),
    ("s3://adapters/team-a/", "s3://adapters/team-a/sql/", True),
    ("s3://adapters/team-a", "s3://adapters/team-a", True),
    ("s3://adapters/team-a", "s3://adapters/team-ab/sql", False),  # a prefix match must end at a '/'
    ("s3://adapters/team-a", "s3://adapters/team-a/./sql", False),  # some S3-compatible stores normalize these
    ("s3://adapters/team-a", "s3://adapters/team-a/../team-b", False),
    ("/srv/adapters", "/srv/adapters-old/sql", False),
    ("/srv/adapters", "/srv/adapters/team-a/sql", True),
])
def test_a_source_is_under_a_root_only_on_a_segment_boundary(root: str, source: str, allowed: bool) -> None:
    access = AdapterAccess(open_without_token=True, roots=(adapter_root(root),))
    lexical = lambda path: os.path.normpath(path)  # noqa: E731 - these paths do not exist here
    try:
        allowed_source(access, source, resolve=lexical)
    except ApiError as exc:
        assert not allowed and exc.status == 403
    else:
        assert allowed


@pytest.mark.parametrize("text", ["s3://", "s3:///prefix", "s3://b/../c", "gs://bucket", "builtin:x", ""])
def test_a_root_that_is_not_a_directory_or_an_s3_prefix_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        adapter_root(text)
