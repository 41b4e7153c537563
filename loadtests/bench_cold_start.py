"""Where a replica's start goes: `kvgate engine` from process start to healthy, phase by phase, from a cold and a
warm page cache, beside the raw read speed of the same weight files measured in the same run.

    python loadtests/bench_cold_start.py [--model builtin:smollm2-135m] [--repeats 3] [--json out.json] [--s3]

Cold: the model's files are evicted from the page cache first (posix_fadvise DONTNEED, no root needed). Each
start is timed from `Popen` to the first 200 from /health, and split by the engine's own `start-up:` log line
(engine/server/main.py). Raw read: the weight files read once cold with 8 MiB reads, as `dd` would.
Prints a table of medians, writes JSON.

--s3 adds loading from S3: a moto server on loopback holds the model's files; each repeat times a plain parallel
download of the weight files with boto3's own transfer manager (16 threads, 16 MiB parts: the baseline), the
engine's fetch (engine/s3_models.py) into an empty cache with the same threads and part size, and an engine
started from s3:// with an empty cache (healthy, and its `source` phase). All three in the same run.
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


def start_once(model: str, cold: bool, model_dir: Path, env: dict[str, str] | None = None) -> dict:
    if cold:
        evict(model_dir)
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "kvgate.engine", "--model", model, "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
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


S3_THREADS, S3_PART_BYTES = 16, 16 << 20


def s3_runs(model_dir: Path, repeats: int) -> dict:
    """Plain parallel download, the engine's fetch, and an engine start from s3://, per repeat."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    from kvgate.engine.s3_models import fetch_s3_model

    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})  # moto's; never real credentials
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="models")
        for path in model_dir.iterdir():
            if path.is_file():
                client.upload_file(str(path), "models", f"smollm2/{path.name}")
        weights = sorted(p.name for p in model_dir.glob("*.safetensors"))
        size = sum((model_dir / name).stat().st_size for name in weights)
        total = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
        transfer = TransferConfig(max_concurrency=S3_THREADS, multipart_chunksize=S3_PART_BYTES,
                                  multipart_threshold=S3_PART_BYTES)
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as scratch:
                started = time.perf_counter()
                for name in weights:
                    client.download_file("models", f"smollm2/{name}", f"{scratch}/{name}", Config=transfer)
                plain = size / (time.perf_counter() - started) / 1e9
            with tempfile.TemporaryDirectory() as cache:
                stats = fetch_s3_model("s3://models/smollm2", Path(cache), endpoint, workers=S3_THREADS,
                                       part_bytes=S3_PART_BYTES)
                fetch = total / stats.seconds / 1e9
            with tempfile.TemporaryDirectory() as cache:
                start = start_once("s3://models/smollm2", False, model_dir,
                                   env={"KVGATE_CACHE_DIR": cache, "KVGATE_S3_ENDPOINT_URL": endpoint})
            runs.append({"plain_download_gb_s": plain, "fetch_gb_s": fetch, "fetch_over_plain": fetch / plain,
                         "engine_healthy_s": start["healthy_s"], "engine_source_s": start["phases"].get("source"),
                         "engine_phases": start["phases"]})
            print(f"s3: plain parallel download {plain:.2f} GB/s, engine fetch {fetch:.2f} GB/s "
                  f"({fetch / plain:.2f}x); engine from s3:// healthy in {start['healthy_s']:.2f} s "
                  f"(source {start['phases'].get('source', 0):.2f} s)", flush=True)
        return {"runs": runs, "median": {key: statistics.median(r[key] for r in runs) for key in
                                         ("plain_download_gb_s", "fetch_gb_s", "fetch_over_plain",
                                          "engine_healthy_s", "engine_source_s")}}
    finally:
        server.terminate()
        server.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--s3", action="store_true", help="also load from a moto S3 server (see above)")
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
    s3 = s3_runs(model_dir, args.repeats) if args.s3 else None
    if s3:
        med = s3["median"]
        print(f"s3 medians: plain parallel download {med['plain_download_gb_s']:.2f} GB/s, engine fetch "
              f"{med['fetch_gb_s']:.2f} GB/s, ratio {med['fetch_over_plain']:.2f}; engine from s3:// healthy "
              f"{med['engine_healthy_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "weight_bytes": size, "raw_read_gb_s": raw,
                                               "runs": rows, "median": summary, "s3": s3}, indent=1))
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
