"""What the chat apps' HTTP clients (``botapi``, ``graph``, ``discord_api``) share: the check of
their retry backoff, and the masking of their secrets in every text they log or raise."""

from __future__ import annotations

import math

from agentloop.urls import MASK


def check_backoff(backoff: tuple[float, float]) -> tuple[float, float]:
    """``backoff`` as (first, longest) seconds between retries, or ValueError."""
    first, longest = backoff
    if not (0 <= first <= longest and math.isfinite(longest)):
        raise ValueError(f"backoff must be (first, longest) seconds with 0 <= first <= longest, got {backoff!r}")
    return float(first), float(longest)


class Masker:
    """Masks ``secrets`` in a text: ``masker(text)``. The longest first, so that a secret holding
    another (a token and its secret half) is masked whole."""

    def __init__(self, *secrets: str) -> None:
        self._secrets = sorted(set(secrets) - {""}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text
