"""``"provider:model"`` strings to ``Model`` objects.

Providers are registered by import path so that an optional SDK (anthropic, llama.cpp) is only
imported when its provider is used. Third parties add their own with ``register_provider``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any, TypeAlias

from agentloop.models.base import Model
from agentloop.models.catalog import CATALOG
from agentloop.models.gguf_assets import is_path_id

ModelFactory: TypeAlias = Callable[[str], Model]

DEFAULT_MODEL = "local:qwen2.5-coder-1.5b"

_PROVIDERS: dict[str, str | ModelFactory] = {
    "openai": "agentloop.models.openai_chat:OpenAIChatModel",
    "openai-responses": "agentloop.models.openai_responses:OpenAIResponsesModel",
    "anthropic": "agentloop.models.anthropic:AnthropicModel",
    "gemini": "agentloop.models.gemini:GeminiModel",
    "local": "agentloop.models.local:LocalModel",
    "scripted": "agentloop.models.scripted:ScriptedModel.from_file",
}


# hosted providers: the SDK they need (None: plain httpx), then the environment variables that make
# them usable (a key, or a base URL for a compatible server that may need none)
HOSTED: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "openai": (None, ("OPENAI_API_KEY", "OPENAI_BASE_URL")),
    "openai-responses": (None, ("OPENAI_API_KEY", "OPENAI_BASE_URL")),
    "anthropic": ("anthropic", ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")),
    "gemini": (None, ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GEMINI_BASE_URL")),
}


def hosted_status(provider: str) -> tuple[bool, str]:
    """Whether a hosted provider can be used here, and why (or what it needs)."""
    package, names = HOSTED[provider]
    if package is not None and importlib.util.find_spec(package) is None:
        return False, f"pip install 'agentloop[{package}]'"
    found = next((name for name in names if os.environ.get(name)), None)
    if found is not None:
        return True, f"{found} is set"
    return False, f"needs {' or '.join(names)}"


def provider_status(provider: str) -> tuple[bool, str]:
    """Whether models of ``provider`` can be called here, and why (or what they need)."""
    if provider in HOSTED:
        return hosted_status(provider)
    if provider == "local":
        if importlib.util.find_spec("llama_cpp") is None:
            return False, "pip install 'agentloop[local]'"
        return True, "runs on this machine"
    return provider in _PROVIDERS, "registered" if provider in _PROVIDERS else "unknown provider"


def catalog() -> list[dict[str, Any]]:
    """The models this runtime knows the facts of (``catalog.CATALOG``), each with whether it can be
    used here: what a model picker offers. Any other ``provider:model`` may still be named."""
    listed = []
    for info in CATALOG.values():
        usable, why = provider_status(info.provider)
        listed.append(
            {
                "model": info.name,
                "context_window": info.context_window,
                "max_output": info.max_output,
                "input_cost": info.input_cost,
                "output_cost": info.output_cost,
                "vision": info.vision,
                "reasoning": info.reasoning,
                "usable": usable,
                "why": why,
            }
        )
    return listed


class ModelNotFound(ValueError):
    """The model string names no known provider, or the provider cannot be loaded."""


def register_provider(name: str, factory: ModelFactory | str) -> None:
    """Make ``name:<model id>`` resolve through ``factory(model_id)``."""
    _PROVIDERS[name] = factory


def providers() -> list[str]:
    return sorted(_PROVIDERS)


def _factory(provider: str) -> ModelFactory:
    target = _PROVIDERS.get(provider)
    if target is None:
        known = ", ".join(providers())
        raise ModelNotFound(f"unknown provider {provider!r} (known: {known})")
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ModelNotFound(
                f"provider {provider!r} needs an optional dependency: pip install 'agentloop[{provider}]' ({exc})"
            ) from exc
        obj: object = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        factory: ModelFactory = obj  # type: ignore[assignment]
        _PROVIDERS[provider] = factory
        return factory
    return target


def parse_model_string(spec: str) -> tuple[str, str]:
    provider, sep, model_id = spec.partition(":")
    if not sep or not provider or not model_id:
        raise ModelNotFound(f"model must look like 'provider:model', got {spec!r}")
    return provider, model_id


def resolve_model(spec: str | Model | None) -> Model:
    """A ``Model`` from a model object, a ``provider:model`` string, or None (the default)."""
    if isinstance(spec, Model):
        return spec
    if spec is None:
        spec = os.environ.get("AGENTLOOP_MODEL") or DEFAULT_MODEL
    provider, model_id = parse_model_string(spec)
    return _factory(provider)(model_id)


def names_a_file(spec: str) -> bool:
    """Whether ``spec`` names a file of the machine that makes the model: a scripted model's
    replies, a local model's weights given by path. Those are for whoever runs the server to pick
    (in ``model.json``, or ``--model``), not for a client of its API to point at any file."""
    provider, _, model_id = spec.partition(":")
    if provider == "scripted":
        return True
    return provider == "local" and ("/" in model_id or "\\" in model_id or is_path_id(model_id))
