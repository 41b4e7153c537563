"""A model's caps on what one request may ask for (the registry's `limits`), checked at the gateway.

Pure checks over the parsed body: each raises ApiError 400 naming the field (`param`) and the cap, so that
a request for 10^12 tokens or 10^6 choices never reaches a replica, and never reserves that much of a
tenant's token budget. Wording and codes follow OpenAI's for the same refusals:

    {"error": {"message": "'n' is 1000000; model 'm' takes at most 16", "type": "BadRequestError",
               "param": "n", "code": "integer_above_max_value"}}
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.openai_wire import ApiError, bad_request, json_type
from kvgate.registry.schema import ModelSpec

# The body's fields each cap bounds: max_completion_tokens is max_tokens' newer name; best_of (vLLM, legacy
# completions) draws that many sequences as n does.
MAX_TOKENS_PARAMS = ("max_tokens", "max_completion_tokens")
CHOICES_PARAMS = ("n", "best_of")
# `code` of every refusal here: the one `router.refusals` counts as "over_cap".
OVER_CAP_CODES = ("integer_above_max_value", "prompt_too_long")


def check_sampling_caps(body: Mapping[str, object], model: str, spec: ModelSpec) -> None:
    """Refuse max_tokens / max_completion_tokens above the model's cap and n / best_of above `limits.max_n`,
    and any of them below 1 (as OpenAI does: a negative max_tokens beside a large max_completion_tokens would
    otherwise shrink the tokens a tenant reserves, `completion_budget`). Each must be an integer when given (as
    OpenAI and the engine require): a float or a numeric string would slip past the cap into a server that
    coerces it. Absent or null: nothing to check."""
    for params, cap in ((MAX_TOKENS_PARAMS, spec.max_tokens_cap), (CHOICES_PARAMS, spec.limits.max_n)):
        for param in params:
            refused = _out_of_range(param, body.get(param), cap, model)
            if refused is not None:
                raise refused


def completion_budget(body: Mapping[str, object], model_cap: int) -> int:
    """The most completion tokens a request checked by `check_sampling_caps` may cost: the larger of max_tokens
    and max_completion_tokens (servers differ on which wins when both are given: the engine, vLLM and the sim
    take max_completion_tokens, so either may be the one in force), or `model_cap` when it names neither (what
    a server may then generate: up to the model's length), times the sequences it draws, max(n, best_of, 1).
    Worked numbers: max_tokens 1, max_completion_tokens 200, n 3 -> 600; neither, cap 2,048 -> 2,048."""
    return max(_given(body, MAX_TOKENS_PARAMS), default=model_cap) * max(_given(body, CHOICES_PARAMS), default=1)


def _given(body: Mapping[str, object], params: tuple[str, ...]) -> list[int]:
    """The values of `params` the body sets (integers of at least 1, once `check_sampling_caps` passed)."""
    return [value for param in params if isinstance(value := body.get(param), int)]


def check_prompt_size(num_prompt_chars: int, model: str, spec: ModelSpec, chat: bool) -> None:
    """Refuse a prompt longer than `limits.max_prompt_chars` (characters of the canonical prompt,
    `features.canonical_prompt`); `chat` names the field: `messages`, else `prompt`."""
    cap = spec.limits.max_prompt_chars
    if cap is not None and num_prompt_chars > cap:
        raise bad_request(f"the prompt is {num_prompt_chars} characters; model '{model}' takes at most {cap} "
                          "(limits.max_prompt_chars)", "messages" if chat else "prompt", code="prompt_too_long")


def _out_of_range(param: str, value: object, cap: int, model: str) -> ApiError | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return bad_request(f"'{param}' must be an integer; got {json_type(value)}", param, code="invalid_type")
    if value < 1:
        return bad_request(f"'{param}' is {value}; it must be at least 1", param, code="integer_below_min_value")
    if value > cap:
        return bad_request(f"'{param}' is {value}; model '{model}' takes at most {cap}", param,
                           code="integer_above_max_value")
    return None
