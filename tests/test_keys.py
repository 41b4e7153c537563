"""`kvgate keys`: a new key printed once with the registry line that admits it; nothing without the secret."""

from __future__ import annotations

import io
import re

import pytest

from kvgate.cli import main
from kvgate.registry.tenant import KEY_SECRET_ENV, TenantSpec, key_hmac

SECRET = "keys-test-secret-0123456789abcdefghij"


def test_create_prints_a_new_key_once_and_the_line_whose_hmac_admits_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(KEY_SECRET_ENV, SECRET)
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    first = capsys.readouterr().out
    assert main(["keys", "create", "--tenant", "acme"]) == 0
    (key,) = re.findall(r"^kvg_[A-Za-z0-9_-]{43}$", first, re.MULTILINE)
    assert key not in capsys.readouterr().out  # random each time
    (line,) = re.findall(r'^  api_key_hmac: "([0-9a-f]{64})"$', first, re.MULTILINE)
    assert line == key_hmac(SECRET.encode(), key)
    assert TenantSpec.model_validate({"api_key_hmac": line, "models": ["*"]}).api_key_hmac == line


def test_hash_gives_the_line_for_an_existing_key_read_from_stdin(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(KEY_SECRET_ENV, SECRET)
    monkeypatch.setattr("sys.stdin", io.StringIO("demo-key-acme\n"))
    assert main(["keys", "hash", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    assert f'api_key_hmac: "{key_hmac(SECRET.encode(), "demo-key-acme")}"' in out and "demo-key-acme" not in out


@pytest.mark.parametrize("secret, says", [(None, f"{KEY_SECRET_ENV} is not set"),
                                          ("short", f"{KEY_SECRET_ENV} is 5 characters; use at least 32")])
def test_no_key_without_a_usable_secret(secret: str | None, says: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    if secret is None:
        monkeypatch.delenv(KEY_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_SECRET_ENV, secret)
    assert main(["keys", "create", "--tenant", "acme"]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and "kvg_" not in captured.out


def test_the_tenant_name_is_checked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(KEY_SECRET_ENV, SECRET)
    assert main(["keys", "create", "--tenant", "Not A Name"]) == 2
    assert "'Not A Name' is not a valid name" in capsys.readouterr().err
