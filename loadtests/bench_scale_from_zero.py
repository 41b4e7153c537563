"""Time to first token from zero replicas through `kvgate up`: one real `kvgate up` (gateway, embedded autoscaler,
local pool) on a registry whose model sits at zero replicas; each repeat sends one streamed chat request and
times its first content token at the client, then waits for the model to scale back to zero.

    .venv/bin/python loadtests/bench_scale_from_zero.py [--model builtin:smollm2-135m] [--repeats 5]

The first repeat also creates the local node (a slot) the replica runs on; later ones find it while the pool's
empty-node grace holds it, so the table shows both. Each answer's phases are read from the logs: when the
engine process started (its start-up line's own age) and when it was healthy. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.common import free_port  # noqa: E402

REGISTRY = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: m}}
spec:
  source: {source}
  engine: {{max_model_len_tokens: 1024, kv_cache_bytes: 64MiB}}
  # Back to zero 2 s after the gateway's 10 s arrival window empties.
  scaling: {{min_replicas: 0, max_replicas: 1, max_queue_wait_s: 60, scale_to_zero_grace_s: 2,
            stable_window_s: 4, panic_window_s: 1, scale_down_delay_s: 0, forecast_enabled: false}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: local}}
spec:
  provider: local
  max_nodes: 1
  node_boot_s: 0
  offers: [{{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}}]
  local: {{host: 127.0.0.1, work_dir: "{work}"}}
"""


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def first_token_s(gateway: str) -> tuple[float, str]:
    """Seconds from sending a streamed chat request to its first content delta; and the text so far."""
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    request = urllib.request.Request(gateway + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content"):
                return time.perf_counter() - started, delta["content"]
    raise RuntimeError("the stream ended without a content token")


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def ready_count(gateway: str) -> int:
    return get_json(gateway + "/admin/stats")["models"]["m"]["num_ready"]


def engine_startups(work: Path) -> list[float]:
    """Each engine's own start-up total (process start to serving), from the replicas' logs."""
    totals = []
    for log in sorted(work.rglob("*.log")):
        totals += [float(m) for m in re.findall(r"start-up: ([0-9.]+) s:", log.read_text(errors="replace"))]
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m", help="the model's source (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=str(REPO / "loadtests" / ".work" / "bench_scale_from_zero.json"))
    args = parser.parse_args()
    from kvgate.engine.builtin import resolve_model_source

    resolve_model_source(args.model)  # built before the clock runs, as `kvgate up` prepares models first
    with tempfile.TemporaryDirectory() as root_name:
        root = Path(root_name)
        (root / "registry").mkdir()
        (root / "registry" / "models.yaml").write_text(REGISTRY.format(source=args.model, work=root / "work"))
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        log_path = root / "up.log"
        with open(log_path, "wb") as log:
            up = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "up", "--registry", str(root / "registry"),
                                   "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        runs = []
        try:
            wait_for(lambda: _answers(gateway + "/health"), "kvgate up's gateway", 120)
            wait_for(lambda: ready_count(gateway) == 0, "the model at zero", 60)
            for i in range(args.repeats):
                seconds, text = first_token_s(gateway)
                startups = engine_startups(root / "work")
                runs.append({"first_token_s": seconds, "engine_startup_s": startups[-1] if startups else None,
                             "first_repeat": i == 0})
                print(f"repeat {i + 1}: first token {seconds:.2f} s from zero ({text!r}); the engine's own start-up "
                      f"{runs[-1]['engine_startup_s'] or float('nan'):.2f} s", flush=True)
                wait_for(lambda: ready_count(gateway) == 0 and not list((root / "work").rglob("replicas/*.json")),
                         "the model back at zero", 120)
        finally:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
            shutil.copy(log_path, Path(args.json).with_suffix(".up.log"))  # kvgate up's log, kept beside the JSON
        later = [r["first_token_s"] for r in runs if not r["first_repeat"]]
        summary = {"first_token_s_all": statistics.median(r["first_token_s"] for r in runs),
                   "first_token_s_node_held": statistics.median(later) if later else None,
                   "engine_startup_s": statistics.median(r["engine_startup_s"] for r in runs if r["engine_startup_s"])}
        print(f"median first token from zero: {summary['first_token_s_all']:.2f} s over {len(runs)} repeats"
              + (f" ({summary['first_token_s_node_held']:.2f} s with the node held)" if later else "")
              + f"; the engine's own start-up {summary['engine_startup_s']:.2f} s")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "median": summary}, indent=2))
        print("wrote", args.json)
    return 0


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
