"""The per-account input rate (server/ratelimit.py): a sliding minute, refusals that say when."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.cli.approvals import parse_approval
from agentloop.cli.config import Settings
from agentloop.cli.serve import ServeOptions
from agentloop.models.registry import register_provider
from agentloop.server.errors import ApiError
from agentloop.server.ratelimit import InputRate
from tests.server_support import serving


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_limit_holds_over_any_minute_and_a_refusal_says_when_to_retry() -> None:
    clock = Clock()
    rate = InputRate(clock)
    rate.take("alice", 3)
    clock.now += 20
    rate.take("alice", 3)
    rate.take("alice", 3)
    with pytest.raises(ApiError) as refused:
        rate.take("alice", 3)
    assert (refused.value.status, refused.value.code) == (429, "rate_limited")
    assert refused.value.retry_after == 40  # the first input leaves the window 60 s after it came
    assert refused.value.response().headers["Retry-After"] == "40"
    rate.take("bob", 3)  # each account has its own
    clock.now += 40  # the first one is out of the window, the refused one was never counted
    rate.take("alice", 3)
    with pytest.raises(ApiError):
        rate.take("alice", 3)
    clock.now += 20  # the two of second 20 are out too
    rate.take("alice", 3)
    rate.take("alice", 3)


def test_no_limit_counts_nothing() -> None:
    rate = InputRate(Clock())
    for _ in range(1000):
        rate.take("alice", None)
    rate.take("alice", 1)  # nothing was counted before


def test_accounts_quiet_for_a_minute_are_forgotten() -> None:
    clock = Clock()
    rate = InputRate(clock)
    for i in range(2000):
        rate.take(f"a{i}", 5)
    clock.now += 61
    rate.take("late", 5)
    assert len(rate._accepted) == 1


def test_serve_applies_its_input_rate(tmp_path: Path) -> None:
    """``serve --max-inputs-per-minute`` reaches the server: the third message of a minute is refused."""
    register_provider("ratelimitprobe", lambda _id: ScriptedModel(lambda request: "ok"))
    opts = ServeOptions(
        "127.0.0.1",
        0,
        (tmp_path / "data").resolve(),
        tmp_path.resolve(),
        Settings(model="ratelimitprobe:x", model_source="test"),
        parse_approval("ask"),
        max_inputs_per_minute=2,
        out=io.StringIO(),
    )
    with serving(opts) as (url, headers), httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        pid = client.post("/v1/processes", json={"text": "one"}).json()["pid"]
        assert client.post(f"/v1/processes/{pid}/messages", json={"text": "two"}).status_code == 202
        refused = client.post(f"/v1/processes/{pid}/messages", json={"text": "three"})
        assert refused.status_code == 429 and refused.json()["code"] == "rate_limited"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
