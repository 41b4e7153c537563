"""Constrained decoding on the CPU: llguidance, xgrammar and outlines-core side by side, for the same JSON schemas
and the same tokenizer (SmolLM2-135M's tokenizer.json, 49,152 tokens).

    .venv/bin/python loadtests/bench_grammar.py [--repeats 20] [--timeout 300] [--json OUT]

Per library: the one-time tokenizer setup (tokenizer.json on disk in, the library's vocabulary object out). Per
library and schema: the cold compile (the first for that schema, the tokenizer already built: schema in, a
matcher ready to use out), a new matcher from the compiled grammar as the next request with that schema would
make, and the next-token mask (a 32-bit bitmask over the vocabulary, written into the same buffer) while walking
a fixed valid instance of the schema token by token: mask, check the token is in it, accept it; at the end EOS
must be in the mask. The instance text and its tokens are the same for every library; each of --repeats walks
starts from a new matcher. Each library's JSON options are its defaults. Prints a table, writes JSON.

The libraries stay out of the project's venv: the script makes loadtests/.work/grammar-venv (torch's CPU build
first, so that pip does not pull a CUDA one), installs the pinned libraries there one by one, and runs itself
there once per library (--worker). A library that fails to install or to run gets a row saying why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.common import percentile  # noqa: E402

WORK = Path(__file__).parent / ".work"
VENV = WORK / "grammar-venv"
TORCH = "torch==2.13.0"
LIBRARIES = {"llguidance": "llguidance==1.9.1", "xgrammar": "xgrammar==0.2.9", "outlines-core": "outlines-core==0.2.14"}

SMALL = {"type": "object",
         "properties": {"name": {"type": "string", "maxLength": 20},
                        "age": {"type": "integer", "minimum": 0, "maximum": 150},
                        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5}},
         "required": ["name", "age", "tags"], "additionalProperties": False}
ITEM = {"type": "object",
        "properties": {"label": {"type": "string"}, "score": {"type": "number"}, "active": {"type": "boolean"},
                       "meta": {"type": "object", "properties": {"level": {"enum": ["low", "medium", "high"]}},
                                "required": ["level"], "additionalProperties": False}},
        "required": ["label", "score", "active", "meta"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 10}},
          "required": ["items"], "additionalProperties": False}
JSON_OBJECT = {"type": "object"}

# (name, schema, a valid instance); the instance is written with json.dumps' default ", " and ": " separators.
CASES = [
    ("small", SMALL, {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c", "b"]}),
    ("nested", NESTED, {"items": [
        {"label": "alpha", "score": 0.75, "active": True, "meta": {"level": "high"}},
        {"label": "beta release", "score": -3.5, "active": False, "meta": {"level": "low"}},
        {"label": "gamma", "score": 12, "active": True, "meta": {"level": "medium"}},
        {"label": "delta 4", "score": 1e-3, "active": False, "meta": {"level": "high"}},
        {"label": "epsilon", "score": 99.125, "active": True, "meta": {"level": "low"}}]}),
    ("json_object", JSON_OBJECT, {"id": 17, "user": {"name": "Grace", "roles": ["admin", "dev"]}, "active": True,
                                  "score": 9.5, "note": None, "tags": ["x", "y"]}),
]


# ---- in the grammar venv (--worker): one library per process ----

def gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet inverted: the character a token string uses for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    for n, byte in enumerate(b for b in range(256) if b not in chars):
        chars[byte] = chr(256 + n)
    return {char: byte for byte, char in chars.items()}


class LLGuidance:
    imports = ("llguidance",)

    def __init__(self, plan: dict) -> None:
        import llguidance
        self.llguidance = llguidance
        self.tokenizer = llguidance.LLTokenizer(Path(plan["tokenizer"]).read_text(), n_vocab=plan["n_vocab"],
                                                eos_token=plan["eos"])

    def compile(self, schema: dict) -> str:
        return self.llguidance.LLMatcher.grammar_from_json_schema(schema)

    def matcher(self, grammar: str):
        matcher = self.llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def fill(self, matcher, mask) -> None:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar:
    imports = ("xgrammar", "transformers")  # xgrammar requires transformers, so the HF tokenizer is always there

    def __init__(self, plan: dict) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgrammar = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=plan["tokenizer"])
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=plan["n_vocab"],
                                                            stop_token_ids=[plan["eos"]])

    def compile(self, schema: dict):
        # A new compiler (microseconds) each time: one shared by the schemas would reuse the rules an earlier
        # schema compiled, and the compile would not be cold.
        return self.xgrammar.GrammarCompiler(self.info).compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgrammar.GrammarMatcher(compiled)

    def fill(self, matcher, mask) -> None:
        matcher.fill_next_token_bitmask(mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore:
    imports = ("outlines_core",)

    def __init__(self, plan: dict) -> None:
        import outlines_core
        self.outlines_core = outlines_core
        spec = json.loads(Path(plan["tokenizer"]).read_text())
        special = {token["id"] for token in spec["added_tokens"] if token["special"]}  # EOS among them
        decoder = gpt2_byte_decoder()
        vocab: dict[bytes, list[int]] = {}
        for text, token_id in spec["model"]["vocab"].items():
            if token_id not in special:
                vocab.setdefault(bytes(decoder[char] for char in text), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(plan["eos"], vocab)

    def compile(self, schema: dict):
        regex = self.outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.outlines_core.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.outlines_core.Guide(index)

    def fill(self, matcher, mask) -> None:
        matcher.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def accept(self, matcher, token: int) -> bool:
        matcher.advance(token, return_tokens=False)  # raises on a token it does not allow
        return True


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def allowed(mask, token: int) -> bool:
    return bool(int(mask[0, token >> 5]) >> (token & 31) & 1)


def walk(adapter, compiled, tokens: list[int], eos: int, mask) -> tuple[float, list[float]]:
    """A new matcher (us), then the mask before each token of the instance (us each)."""
    started = time.perf_counter()
    matcher = adapter.matcher(compiled)
    new_matcher_us = (time.perf_counter() - started) * 1e6
    mask_us = []
    for i, token in enumerate(tokens):
        started = time.perf_counter()
        adapter.fill(matcher, mask)
        mask_us.append((time.perf_counter() - started) * 1e6)
        if not allowed(mask, token):
            raise RuntimeError(f"token {i} ({token}) of the instance is not in the mask")
        if not adapter.accept(matcher, token):
            raise RuntimeError(f"token {i} ({token}) of the instance was rejected")
    adapter.fill(matcher, mask)
    if not allowed(mask, eos):
        raise RuntimeError("EOS is not in the mask after the whole instance")
    return new_matcher_us, mask_us


def measure_case(adapter, case: dict, plan: dict, mask) -> dict:
    started = time.perf_counter()
    compiled = adapter.compile(case["schema"])
    adapter.matcher(compiled)
    compile_ms = (time.perf_counter() - started) * 1e3
    walks = [walk(adapter, compiled, case["tokens"], plan["eos"], mask) for _ in range(plan["repeats"])]
    return {"compile_ms": compile_ms, "new_matcher_us": [w[0] for w in walks], "mask_us": [w[1] for w in walks]}


def worker(library: str) -> int:
    """Measures `library` for the plan on stdin; prints the result as JSON on the last line of stdout."""
    import importlib
    import importlib.metadata

    plan = json.load(sys.stdin)
    adapter_class = ADAPTERS[library]
    result: dict = {"library": library, "version": importlib.metadata.version(library)}
    try:
        started = time.perf_counter()
        for name in adapter_class.imports:
            importlib.import_module(name)
        import torch
        result["import_ms"] = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        adapter = adapter_class(plan)
        result["tokenizer_setup_ms"] = (time.perf_counter() - started) * 1e3
    except Exception as error:  # noqa: BLE001 - reported in the table
        result["error"] = f"setup: {type(error).__name__}: {error}"
    else:
        mask = torch.zeros((1, (plan["n_vocab"] + 31) // 32), dtype=torch.int32)
        result["cases"] = {}
        for case in plan["cases"]:
            try:
                result["cases"][case["name"]] = measure_case(adapter, case, plan, mask)
            except Exception as error:  # noqa: BLE001 - reported in the table
                result["cases"][case["name"]] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result))
    return 0


# ---- in the project's venv ----

def make_plan(model: str, repeats: int) -> dict:
    """The tokenizer, its EOS and vocabulary size, and each case's schema, instance text and its tokens."""
    from tokenizers import Tokenizer

    from kvgate.engine.builtin import resolve_model_source

    model_dir = resolve_model_source(model)
    config = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    tokenizer_path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    cases = []
    for name, schema, instance in CASES:
        text = json.dumps(instance, separators=(", ", ": "))
        cases.append({"name": name, "schema": schema, "instance": text,
                      "tokens": tokenizer.encode(text, add_special_tokens=False).ids})
    return {"tokenizer": str(tokenizer_path), "n_vocab": config["vocab_size"],
            "eos": eos if eos is not None else config["eos_token_id"], "repeats": repeats, "cases": cases}


def pip_install(python: Path, requirement: str) -> str | None:
    """Installs `requirement` into the venv of `python`; None, or pip's error."""
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    return " ".join(errors or done.stderr.splitlines()[-1:]) or f"pip exited with {done.returncode}"


def grammar_python() -> Path:
    """The interpreter of the grammar venv, made if missing, with torch's CPU build in it."""
    python = VENV / "bin" / "python"
    if not python.exists():
        print("creating", VENV, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if problem := pip_install(python, TORCH):
        raise SystemExit(f"cannot install {TORCH} into {VENV}: {problem}")
    return python


def run_library(python: Path, library: str, plan: dict, timeout_s: float) -> dict:
    """Installs `library` and measures it in a worker process; a row with "error" when either fails."""
    version = LIBRARIES[library].partition("==")[2]
    if problem := pip_install(python, LIBRARIES[library]):
        return {"library": library, "version": version, "error": f"install: {problem}"}
    try:
        done = subprocess.run([str(python), __file__, "--worker", library], input=json.dumps(plan),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"library": library, "version": version, "error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        return {"library": library, "version": version, "error": f"worker exited with {done.returncode}: {tail[0]}"}
    return json.loads(lines[-1])


def summarize(result: dict, case: str) -> dict:
    """One table row: the medians and the p99 over every token of every walk."""
    measured = result["cases"][case]
    if "error" in measured:
        return {"error": measured["error"]}
    samples = sorted(us for walk_us in measured["mask_us"] for us in walk_us)
    return {"compile_ms": measured["compile_ms"], "new_matcher_us": statistics.median(measured["new_matcher_us"]),
            "mask_us_median": statistics.median(samples), "mask_us_p99": percentile(samples, 0.99),
            "first_mask_us": statistics.median(walk_us[0] for walk_us in measured["mask_us"]),
            "masks": len(samples)}


COLUMNS = [("library", "library"), ("version", "version"), ("schema", "schema"),
           ("tokenizer setup ms", "tokenizer_setup_ms"), ("compile ms", "compile_ms"),
           ("new matcher us", "new_matcher_us"), ("mask us median", "mask_us_median"),
           ("mask us p99", "mask_us_p99"), ("first mask us", "first_mask_us")]


def table_rows(results: list[dict]) -> list[dict]:
    rows = []
    for result in results:
        head = {key: result.get(key) for key in ("library", "version", "tokenizer_setup_ms")}
        if "error" in result:
            rows.append({**head, "schema": None, "error": result["error"]})
        else:
            rows.extend({**head, "schema": case, **summarize(result, case)} for case in result["cases"])
    return rows


def markdown(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"{value:.2f}" if isinstance(value, float) else str(value or "-")
                 for value in (row.get(key) for _, key in COLUMNS)]
        if "error" in row:
            cells[4:] = [f"failed: {row['error']}"] + [""] * (len(COLUMNS) - 5)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m", help="whose tokenizer.json (kvgate's names)")
    parser.add_argument("--repeats", type=int, default=20, help="walks over each instance, each from a new matcher")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one library may take")
    parser.add_argument("--json", default=str(WORK / "bench_grammar.json"), help="where the results go")
    parser.add_argument("--worker", choices=list(LIBRARIES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    WORK.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args.model, args.repeats)
    python = grammar_python()
    print(f"{plan['tokenizer']}: {plan['n_vocab']} tokens, EOS {plan['eos']}; instances of "
          + ", ".join(f"{case['name']} {len(case['tokens'])}" for case in plan["cases"])
          + f" tokens; {args.repeats} walks each", flush=True)
    results = []
    for library in LIBRARIES:
        started = time.perf_counter()
        results.append(run_library(python, library, plan, args.timeout))
        print(f"{library}: {time.perf_counter() - started:.1f} s", flush=True)
    rows = table_rows(results)
    print("\n".join(markdown(rows)))
    Path(args.json).write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv), "python": platform.python_version(), "cpus": os.cpu_count(),
        "plan": plan, "rows": rows, "results": results}, indent=1))
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
