"""Constrained decoding: output that must match a JSON schema or a grammar, through llguidance.

Why llguidance (measured here with SmolLM2's 49,152-token vocabulary, `loadtests/bench_grammar.py`; the table
is in docs/benchmarks.md): it compiles a schema in 0.3-0.7 ms where xgrammar 0.2.9 takes 2.5-6.6 ms and
outlines-core 0.2.14 84 ms to 4.5 s (it builds an index over the vocabulary up front); it needs neither torch
nor transformers (xgrammar brings both, and triton: a 2.2 GB environment); and it refuses a schema keyword it
cannot enforce, naming it (tests/engine/test_samples_and_constraints.py). Its masks are slower than the others' (median 5-9 us a token against
1 us for xgrammar) but that is under 0.1% of a decode step, and vLLM and SGLang ship it as a backend.

Per step, for each row of the logits whose sequence is constrained, `GrammarBook.mask` fills that row's
bitmask from the sequence's matcher and sets every token the grammar forbids to -inf; other rows are
untouched. After sampling, `advance` feeds each constrained sequence its token; a matcher that can
take no further token (the JSON is complete) finishes the sequence. Grammars are compiled once per
constraint and kept (least recently used dropped past `max_grammars`); a matcher per sequence.

JSON is generated compactly (", " and ": " separators, no free whitespace): a model with random
weights would otherwise fill the output with blanks (flexible whitespace lets it), and real models
write JSON that way anyway.
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvgate.engine.sequence import Constraint, ConstraintKind

if TYPE_CHECKING:  # both imported on first use: an engine that never constrains never loads llguidance
    import llguidance
    import torch

MAX_GRAMMARS = 256
MAX_GRAMMAR_BYTES = 64 << 20  # of grammar text kept; a schema is capped by the request body's size (8 MiB)
# llguidance's JSON options for every schema kvgate compiles (response_format and tool calls alike).
COMPACT_JSON = MappingProxyType({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})


class GrammarStep(enum.Enum):
    CONTINUE = "continue"
    COMPLETE = "complete"
    REJECTED = "rejected"


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the part of the schema or grammar at fault."""


class GrammarBook:
    """Compiled grammars for one model's tokenizer, and the matcher of each constrained sequence.

    A compiled grammar is a ready matcher (llguidance builds one in 0.1-100 ms, longer for a huge schema) kept
    as a prototype; each sequence gets a copy of it (~40 us), so the engine's worker thread does not build one
    for a schema the server compiled first (unless it was evicted in between: then the engine compiles it). `compile` may be called from any thread (the server compiles a
    request's constraint on a worker thread before queuing it); the rest only from the engine's worker
    thread, which owns the sequences' matchers. Prototypes are kept by a hash of their constraint, least
    recently used dropped past `max_grammars` or `max_grammar_bytes` of grammar text."""

    def __init__(self, tokenizer_json: Callable[[], str], eos_token_ids: Sequence[int], vocab_size: int,
                 max_grammars: int = MAX_GRAMMARS, max_grammar_bytes: int = MAX_GRAMMAR_BYTES) -> None:
        self._tokenizer_json = tokenizer_json  # called on first use: an engine that never constrains never pays it
        self._eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size  # rows of logits are this wide (the model's vocabulary)
        self._max_grammars, self._max_grammar_bytes = max_grammars, max_grammar_bytes
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~0.2 s for a 49k vocabulary
        self._prototypes: OrderedDict[bytes, tuple[llguidance.LLMatcher, int]] = OrderedDict()  # key -> (matcher, bytes)
        self._prototype_bytes = 0
        self._matchers: dict[int, llguidance.LLMatcher] = {}

    def _tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                           eos_token=self._eos_token_ids or None)
            return self._lltokenizer

    def compile(self, constraint: Constraint) -> None:
        """Compile `constraint` into a kept prototype matcher, unless one is kept. Raises GrammarError for a
        grammar llguidance refuses (naming what), or one that allows no output at all."""
        self._prototype(constraint)

    def _prototype(self, constraint: Constraint) -> llguidance.LLMatcher:
        key = hashlib.sha256(f"{constraint.kind.value}\0{constraint.source}".encode()).digest()
        with self._lock:
            kept = self._prototypes.get(key)
            if kept is not None:
                self._prototypes.move_to_end(key)
                return kept[0]
        import llguidance

        grammar = _grammar_text(constraint)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_stopped() or probe.is_error():
            raise GrammarError("it allows no output at all (a reference loop, or keywords that contradict each other)")
        with self._lock:
            if key in self._prototypes:  # another thread compiled it meanwhile: keep one, count it once
                return self._prototypes[key][0]
            self._prototypes[key] = (matcher, len(grammar))
            self._prototype_bytes += len(grammar)
            while len(self._prototypes) > 1 and (len(self._prototypes) > self._max_grammars
                                                 or self._prototype_bytes > self._max_grammar_bytes):
                _, (_, size) = self._prototypes.popitem(last=False)
                self._prototype_bytes -= size
        return matcher

    # ----- per sequence (engine thread)

    def start(self, seq_id: int, constraint: Constraint) -> None:
        """Give sequence `seq_id` a fresh matcher (a copy of the constraint's prototype). Raises GrammarError."""
        self._matchers[seq_id] = self._prototype(constraint).deep_copy()

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[int]) -> torch.Tensor:
        """`logits` with the tokens the grammar forbids at -inf in the rows of constrained sequences (row i
        belongs to seq_ids[i]); other rows as they are. `logits` itself when no row is constrained."""
        rows = [(i, self._matchers[s]) for i, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return logits
        import torch

        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        for j, (_, matcher) in enumerate(rows):
            row = bitmask[j]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        forbidden = torch.zeros(logits.shape, dtype=torch.bool)
        forbidden[[i for i, _ in rows]] = ~_unpack_bits(bitmask, logits.shape[1])
        return logits.masked_fill(forbidden.to(logits.device), float("-inf"))

    def advance(self, seq_id: int, token_id: int) -> GrammarStep:
        """Feed a constrained sequence its sampled token. COMPLETE: the grammar takes no further token (the
        sequence should stop); REJECTED: the token broke it (the mask allowed it, so a bug). Unconstrained
        sequences always CONTINUE."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return GrammarStep.CONTINUE
        if not matcher.consume_token(token_id):
            return GrammarStep.REJECTED
        return GrammarStep.COMPLETE if matcher.is_stopped() else GrammarStep.CONTINUE


def _grammar_text(constraint: Constraint) -> str:
    import llguidance

    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.source, defaults=dict(COMPACT_JSON))
        except (ValueError, RecursionError) as exc:
            raise GrammarError(f"the JSON schema cannot be read: {_first_line(str(exc))}") from exc
    return llguidance.LLMatcher.grammar_from_lark(constraint.source)


def _first_line(message: str) -> str:
    """llguidance's error without the grammar text it appends (which repeats the whole schema)."""
    text = str(message).split("<state>")[0].split("<grammar>")[0]
    return " ".join(text.split())[:1000]


def _unpack_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 (bit b of word w allows token 32 w + b) -> [rows, vocab] bool. Little-endian:
    byte k of the int32 view holds tokens 8 k .. 8 k + 7, bit j token 8 k + j."""
    import torch

    as_bytes = bitmask.view(torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
