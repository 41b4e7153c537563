"""Where a replica's start goes: `kvgate engine` from process start to healthy, phase by phase, from a cold and a
warm page cache, beside the raw read speed of the same weight files measured in the same run.

    python loadtests/bench_cold_start.py [--model builtin:smollm2-135m] [--repeats 3] [--json out.json]

Cold: the model's files are evicted from the page cache first (posix_fadvise DONTNEED, no root needed). Each
start is timed from `Popen` to the first 200 from /health, and split by the engine's own `start-up:` log line
(engine/server/main.py). Raw read: the weight files read once cold with 8 MiB reads, as `dd` would.
Prints a table of medians, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

CHUNK = 8 << 20


def evict(model_dir: Path) -> None:
    for path in model_dir.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_read_gb_s(model_dir: Path) -> float:
    evict(model_dir)
    total, started = 0, time.perf_counter()
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                total += len(chunk)
    return total / (time.perf_counter() - started) / 1e9


def start_once(model: str, cold: bool, model_dir: Path) -> dict:
    if cold:
        evict(model_dir)
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "kvgate.engine", "--model", model, "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    if process.poll() is not None:
                        raise RuntimeError(f"the engine exited: {Path(log.name).read_text()[-2000:]}") from None
                    time.sleep(0.02)
            healthy = time.perf_counter() - started
            deadline = time.monotonic() + 10
            while not (line := re.search(r"start-up: ([0-9.]+) s: (.*)", Path(log.name).read_text())):
                if time.monotonic() > deadline:
                    raise RuntimeError("no start-up line in the engine's log")
                time.sleep(0.05)
        finally:
            process.terminate()
            process.wait(30)
    phases = {name: float(value) for name, value in re.findall(r"([a-z_]+) ([0-9.]+)", line[2])}
    rate = re.search(r"weights [0-9.]+ \(([0-9]+) MB, ([0-9.]+) GB/s\)", line[2])
    return {"healthy_s": healthy, "phases": phases, "weights_gb_s": float(rate[2]) if rate else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()

    from kvgate.engine.builtin import resolve_model_source
    model_dir = resolve_model_source(args.model)
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    start_once(args.model, False, model_dir)  # a first start: builds caches, fills the page cache
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    raw = []
    for _ in range(args.repeats):
        raw.append(raw_read_gb_s(model_dir))
        rows["cold"].append(start_once(args.model, True, model_dir))
        rows["warm"].append(start_once(args.model, False, model_dir))
    print(f"{args.model}: {size / 1e6:.0f} MB of weights; raw cold read {statistics.median(raw):.2f} GB/s "
          f"(median of {args.repeats}: {', '.join(f'{r:.2f}' for r in raw)})")
    names = list(rows["cold"][0]["phases"])
    print(f"{'cache':5} {'healthy s':>9}  " + " ".join(f"{n:>12}" for n in names) + "  weights GB/s")
    summary = {}
    for cache, runs in rows.items():
        med = {n: statistics.median(r["phases"].get(n, 0.0) for r in runs) for n in names}
        healthy = statistics.median(r["healthy_s"] for r in runs)
        rate = statistics.median(r["weights_gb_s"] for r in runs if r["weights_gb_s"])
        summary[cache] = {"healthy_s": healthy, "phases": med, "weights_gb_s": rate}
        print(f"{cache:5} {healthy:9.2f}  " + " ".join(f"{med[n]:12.2f}" for n in names) + f"  {rate:12.2f}")
    print(f"weights load / raw read, cold: {summary['cold']['weights_gb_s'] / statistics.median(raw):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "weight_bytes": size, "raw_read_gb_s": raw,
                                               "runs": rows, "median": summary}, indent=1))
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
