"""What `bench_gateway_overhead.py` needs for its rows with auth and limits on: one Tenant with a fresh key (its
HMAC under a fresh server secret in the registry, the key for the load generator) and rate limits far above
anything a benchmark offers, so every request pays for the HMAC, the tenant lookup, the admission (two token
buckets and the in-flight counter in the state store) and the settlement, and none is ever refused; and a
throwaway redis-server for the row whose limits live in Redis."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvgate.registry.tenant import KEY_SECRET_ENV, key_hmac

# The load generator reads the tenant's key from here (never from its command line, which `ps` shows).
API_KEY_ENV = "KVGATE_BENCH_API_KEY"
# 10^9 requests and 10^10 tokens a minute, 10^5 at once: a bucket that never runs dry at 1,000 requests/s of
# ~6 tokens each, yet every request still takes from both buckets and counts itself in flight.
HIGH_LIMITS = "{requests_per_minute: 1.0e9, tokens_per_minute: 1.0e10, max_concurrent_requests: 100000}"


@dataclass(frozen=True)
class TenantCredentials:
    secret: str  # the gateway's KVGATE_KEY_SECRET
    api_key: str  # what the load generator sends as `Authorization: Bearer`

    @classmethod
    def new(cls) -> TenantCredentials:
        return cls(secret=secrets.token_urlsafe(32), api_key=secrets.token_urlsafe(32))

    def gateway_env(self) -> dict[str, str]:
        return {KEY_SECRET_ENV: self.secret}

    def load_env(self) -> dict[str, str]:
        return {API_KEY_ENV: self.api_key}


def write_tenant(directory: Path, credentials: TenantCredentials) -> None:
    """Declare Tenant `bench` (all models, HIGH_LIMITS) beside the registry's model in `directory`."""
    digest = key_hmac(credentials.secret.encode(), credentials.api_key)
    (directory / "tenants.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Tenant
metadata: {{name: bench}}
spec: {{api_key_hmac: "{digest}", models: ['*'], rate_limits: {HIGH_LIMITS}}}
""")


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(port: int, work: Path, timeout_s: float = 10.0) -> Iterator[str]:
    """An empty redis-server on loopback `port` (no persistence) until the block ends; yields its URL.
    Raises RuntimeError when there is no redis-server binary or it does not answer PING in `timeout_s`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no redis-server on PATH (apt-get install redis-server)")
    log = (work / "bench_gateway_overhead-redis.log").open("w")
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", str(work)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not answer PING (see {log.name})")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)
        log.close()
