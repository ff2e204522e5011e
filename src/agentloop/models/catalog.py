"""Facts about known models, in one place: context window, output cap, price, capabilities.

Prices are dollars per million tokens (input, output, cache read, cache write). A model that is
not listed still works: it gets its provider's defaults, with no price.
"""

from __future__ import annotations

import re
from dataclasses import replace

from agentloop.models.base import ModelInfo


def _m(
    provider: str,
    id: str,
    window: int,
    out: int,
    price: tuple[float, float, float, float],
    vision: bool = False,
    reasoning: bool = False,
) -> ModelInfo:
    return ModelInfo(
        provider=provider,
        id=id,
        context_window=window,
        max_output=out,
        input_cost=price[0],
        output_cost=price[1],
        cache_read_cost=price[2],
        cache_write_cost=price[3],
        vision=vision,
        reasoning=reasoning,
    )


CATALOG: dict[str, ModelInfo] = {
    m.name: m
    for m in [
        _m("openai", "gpt-4o", 128_000, 16_384, (2.5, 10.0, 1.25, 0.0), vision=True),
        _m("openai", "gpt-4o-mini", 128_000, 16_384, (0.15, 0.6, 0.075, 0.0), vision=True),
        _m("openai", "gpt-4.1", 1_047_576, 32_768, (2.0, 8.0, 0.5, 0.0), vision=True),
        _m("openai", "gpt-4.1-mini", 1_047_576, 32_768, (0.4, 1.6, 0.1, 0.0), vision=True),
        _m("openai", "o4-mini", 200_000, 100_000, (1.1, 4.4, 0.275, 0.0), vision=True, reasoning=True),
        _m("openai", "o3", 200_000, 100_000, (2.0, 8.0, 0.5, 0.0), vision=True, reasoning=True),
        _m("openai", "gpt-5", 400_000, 128_000, (1.25, 10.0, 0.125, 0.0), vision=True, reasoning=True),
        _m("openai", "gpt-5-mini", 400_000, 128_000, (0.25, 2.0, 0.025, 0.0), vision=True, reasoning=True),
        _m("openai", "gpt-5-nano", 400_000, 128_000, (0.05, 0.4, 0.005, 0.0), vision=True, reasoning=True),
        _m("anthropic", "claude-sonnet-4-5", 200_000, 64_000, (3.0, 15.0, 0.3, 3.75), vision=True, reasoning=True),
        _m("anthropic", "claude-opus-4-1", 200_000, 32_000, (15.0, 75.0, 1.5, 18.75), vision=True, reasoning=True),
        _m("anthropic", "claude-haiku-4-5", 200_000, 64_000, (1.0, 5.0, 0.1, 1.25), vision=True, reasoning=True),
        # Gemini: prices for prompts up to 200k tokens; thinking is billed as output
        _m("gemini", "gemini-2.5-pro", 1_048_576, 65_536, (1.25, 10.0, 0.125, 0.0), vision=True, reasoning=True),
        _m("gemini", "gemini-2.5-flash", 1_048_576, 65_536, (0.3, 2.5, 0.03, 0.0), vision=True, reasoning=True),
        _m("gemini", "gemini-2.5-flash-lite", 1_048_576, 65_536, (0.1, 0.4, 0.01, 0.0), vision=True, reasoning=True),
        _m("gemini", "gemini-2.0-flash", 1_048_576, 8_192, (0.1, 0.4, 0.025, 0.0), vision=True),
        _m("local", "qwen2.5-coder-1.5b", 32_768, 2_048, (0.0, 0.0, 0.0, 0.0)),
        _m("local", "qwen2.5-coder-0.5b", 32_768, 2_048, (0.0, 0.0, 0.0, 0.0)),
    ]
}

PROVIDER_DEFAULTS: dict[str, ModelInfo] = {
    "openai": ModelInfo(provider="openai", id="", context_window=128_000, max_output=4_096),
    "anthropic": ModelInfo(provider="anthropic", id="", context_window=200_000, max_output=8_192, vision=True),
    "gemini": ModelInfo(provider="gemini", id="", context_window=1_048_576, max_output=8_192, vision=True),
    "local": ModelInfo(provider="local", id="", context_window=32_768, max_output=2_048),
}


# a pinned snapshot's date: OpenAI's ``gpt-4o-2024-08-06``, Anthropic's ``claude-sonnet-4-5-20250929``
_SNAPSHOT = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")


def model_info(provider: str, id: str) -> ModelInfo:
    """The catalog entry for ``provider:id``, or the provider's defaults under that id.

    A dated snapshot of a listed model has that model's facts under its own id: taken for an
    unknown model it was free (a cost guard never fired), had the default window and was not
    known to reason (OpenAI refuses ``max_tokens`` from a reasoning model)."""
    known = CATALOG.get(f"{provider}:{id}")
    if known is not None:
        return known
    alias = CATALOG.get(f"{provider}:{_SNAPSHOT.sub('', id)}")
    if alias is not None:
        return replace(alias, id=id)
    base = PROVIDER_DEFAULTS.get(provider, ModelInfo(provider=provider, id=id))
    return ModelInfo(
        provider=provider,
        id=id,
        context_window=base.context_window,
        max_output=base.max_output,
        vision=base.vision,
        reasoning=base.reasoning or (provider in _REASONING and _REASONING[provider].match(id) is not None),
    )


# Each provider's reasoning families, for the models not listed yet (a run's reasoning level is
# sent only to a model known to reason, so one unknown would drop it without a word). OpenAI's
# refuse ``max_tokens`` and take ``reasoning_effort``: o1, o3, o4 and gpt-5 (but not its chat
# variant, which does not reason). Anthropic's thinking models: Claude 3.7 Sonnet and the 4th
# generation on; Gemini's: 2.5 (previews too) and later.
_REASONING = {
    "openai": re.compile(r"(?:o[134](?:-|$)|gpt-5(?!-chat))"),
    "anthropic": re.compile(r"claude-(?:3-7-sonnet|(?:opus|sonnet|haiku)-[4-9])"),
    "gemini": re.compile(r"(?:models/)?gemini-(?:2\.5|[3-9](?:\.\d+)?)-"),
}
