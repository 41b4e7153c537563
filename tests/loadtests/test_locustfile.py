"""loadtests/locustfile.py: a real headless locust run against the gateway over simulated replicas."""

from __future__ import annotations

import asyncio
import csv
import os
import sys
from pathlib import Path

from tests.router.sim_gateway import gateway


def locust_command() -> list[str]:
    script = Path(sys.executable).with_name("locust")
    return [str(script)] if script.exists() else [sys.executable, "-m", "locust"]


async def test_a_headless_locust_run_through_the_gateway_succeeds(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    async with gateway(tmp_path, num_replicas=2) as gw:
        env = {**os.environ, "KVGATE_MODEL": "m", "KVGATE_ADAPTERS": "sql", "KVGATE_MAX_TOKENS": "4",
               "KVGATE_PREFIX_CHARS": "600"}
        process = await asyncio.create_subprocess_exec(
            *locust_command(), "-f", str(root / "loadtests" / "locustfile.py"), "--headless", "-u", "8", "-r", "8",
            "-t", "4s", "--host", gw.url, "--csv", str(tmp_path / "run"), "--only-summary", "--stop-timeout", "2",
            env=env, cwd=root, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, output.decode()[-3000:]
    with open(tmp_path / "run_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 20 and int(total["Failure Count"]) == 0, total
    for name in ("chat", "chat stream", "shared prefix", "adapter", "chat stream ttft"):
        assert int(rows[name]["Request Count"]) > 0, f"no '{name}' requests:\n{output.decode()[-2000:]}"
