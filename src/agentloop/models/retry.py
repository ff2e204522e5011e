"""When and how long to wait before calling a provider again."""

from __future__ import annotations

import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from time import time


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient failures (429, 5xx, connection).

    A server-requested delay (``retry-after``) is honoured; one longer than ``max_delay`` is not
    waited for: the call fails over to the next model (or the run ends) instead.
    """

    max_retries: int = 3
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: float = 0.1

    def delay(self, attempt: int, retry_after: float | None = None) -> float | None:
        """Seconds to wait before retry number ``attempt`` (1-based), or None to give up."""
        if attempt > self.max_retries:
            return None
        if retry_after is not None:
            return retry_after if retry_after <= self.max_delay else None
        d = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return float(d * (1 + random.uniform(-self.jitter, self.jitter)))


NO_RETRY = RetryPolicy(max_retries=0)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` (seconds or HTTP date) or ``retry-after-ms`` header values, in seconds."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time())
    except (TypeError, ValueError):
        return None


def retry_after_from_headers(headers: object) -> float | None:
    """Read the retry delay from response headers (any mapping with ``get``)."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    ms = get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    return parse_retry_after(get("retry-after"))
