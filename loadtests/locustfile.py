"""Load-test any OpenAI-compatible gateway (kvgate or another) with locust.

    locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 30s --host http://127.0.0.1:8080

Four kinds of user, mixed by weight, each sending OpenAI chat completions:

  ChatUser           non-streamed chat, a distinct short question each time
  StreamingUser      streamed chat (SSE) read to `data: [DONE]`; also reports time to first event ("ttft")
  SharedPrefixUser   streamed chat under one of a few long system prompts, which many requests share:
                     what a cache-aware router should turn into KV-cache hits
  AdapterUser        streamed chat naming a LoRA adapter (only when KVGATE_ADAPTERS is set)

A stream counts as failed when it carries an SSE error event or ends without `[DONE]`.

Settings, from the environment:

  KVGATE_MODEL                 model name to send (default: tiny-llama)
  KVGATE_ADAPTERS              comma-separated adapter names for AdapterUser (default: none, user off)
  KVGATE_MAX_TOKENS            max_tokens per request (default: 16)
  KVGATE_API_KEY               sent as `Authorization: Bearer ...` when set
  KVGATE_NUM_SHARED_PREFIXES   distinct long system prompts (default: 4)
  KVGATE_PREFIX_CHARS          length of each shared system prompt in characters (default: 2000)
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("KVGATE_MODEL", "tiny-llama")
ADAPTERS = tuple(a.strip() for a in os.environ.get("KVGATE_ADAPTERS", "").split(",") if a.strip())
MAX_TOKENS = int(os.environ.get("KVGATE_MAX_TOKENS", "16"))
API_KEY = os.environ.get("KVGATE_API_KEY", "")
NUM_SHARED_PREFIXES = int(os.environ.get("KVGATE_NUM_SHARED_PREFIXES", "4"))
PREFIX_CHARS = int(os.environ.get("KVGATE_PREFIX_CHARS", "2000"))

_WORDS = ("alpha", "bravo", "cache", "delta", "echo", "gamma", "index", "kilo", "metro", "nova", "prefix",
          "quartz", "radix", "sierra", "tango", "vector", "router", "replica", "token", "block")
_sequence = itertools.count()  # distinct questions across users of this locust process


def paragraph(seed: object, num_chars: int) -> str:
    """Deterministic text: the same seed gives the same words in every process (and every run)."""
    rng = random.Random(f"kvgate-locust:{seed}")
    words: list[str] = []
    size = 0
    while size < num_chars:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:num_chars]


SHARED_PREFIXES = tuple(f"You are assistant {i}. " + paragraph(("system", i), PREFIX_CHARS)
                        for i in range(NUM_SHARED_PREFIXES))
ADAPTER_PROMPTS = {name: f"You answer with the {name} adapter. " + paragraph(("adapter", name), PREFIX_CHARS // 4)
                   for name in ADAPTERS}


def question() -> str:
    n = next(_sequence)
    return f"Question {n} from {os.getpid()}: " + paragraph(("question", os.getpid(), n), 80)


class _OpenAIUser(HttpUser):
    abstract = True
    wait_time = between(0.0, 0.2)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if API_KEY:
            headers["Authorization"] = f"Bearer {API_KEY}"
        return headers

    def chat(self, name: str, model: str, messages: list[dict[str, str]]) -> None:
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS}
        with self.client.post("/v1/chat/completions", data=json.dumps(body), headers=self.headers(), name=name,
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            try:
                reply = response.json()
                reply["choices"][0]["message"]
            except (ValueError, KeyError, IndexError, TypeError):
                response.failure(f"not a chat completion: {response.text[:200]}")

    def stream(self, name: str, model: str, messages: list[dict[str, str]]) -> None:
        """A streamed chat read to its end; fires an extra "ttft" sample for the first event."""
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        with self.client.post("/v1/chat/completions", data=json.dumps(body), headers=self.headers(), name=name,
                              stream=True, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            first_at, done, error = None, False, None
            for line in response.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                if first_at is None:
                    first_at = time.perf_counter()
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                elif b'"error"' in data:
                    error = data[:200].decode(errors="replace")
            if error or not done:
                response.failure(error or "the stream ended without [DONE]")
                return
        if first_at is not None:
            self.environment.events.request.fire(
                request_type="SSE", name=f"{name} ttft", response_time=(first_at - started) * 1e3,
                response_length=0, exception=None, context={})


class ChatUser(_OpenAIUser):
    weight = 2

    @task
    def chat_once(self) -> None:
        self.chat("chat", MODEL, [{"role": "user", "content": question()}])


class StreamingUser(_OpenAIUser):
    weight = 3

    @task
    def stream_once(self) -> None:
        self.stream("chat stream", MODEL, [{"role": "user", "content": question()}])


class SharedPrefixUser(_OpenAIUser):
    weight = 4

    @task
    def shared_prefix(self) -> None:
        system = random.choice(SHARED_PREFIXES)
        self.stream("shared prefix", MODEL, [{"role": "system", "content": system},
                                             {"role": "user", "content": question()}])


class AdapterUser(_OpenAIUser):
    weight = 2 if ADAPTERS else 0
    abstract = not ADAPTERS  # without adapters the user is not run at all

    @task
    def adapter(self) -> None:
        name = random.choice(ADAPTERS)
        self.stream("adapter", name, [{"role": "system", "content": ADAPTER_PROMPTS[name]},
                                      {"role": "user", "content": question()}])
