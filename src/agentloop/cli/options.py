"""The options several commands share: what a process runs on (model, workspace, system prompt,
data directory, store), and the run limits with the one value they make.

When a limit is used up the model answers once more without tools and the run ends with the
limit's name as its stop reason (``Guards``). Each flag wins over the config file's key of the same
name; the values are checked in ``cli.config`` with the keys', so a flag and a key fail alike.
Kept in a module of their own because ``cli.serve`` needs them and cannot import ``cli.main``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentloop.cli.config import LoopFlags

# a server the client commands (``cli/client.py``) and ``agentloop device token|forget`` ask
ServerOpt = Annotated[
    str | None,
    typer.Option("--server", help="Server URL (default: $AGENTLOOP_SERVER, the config file, http://127.0.0.1:8765)."),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", help="Bearer token (default: $AGENTLOOP_TOKEN, the config file's token).", show_default=False
    ),
]


def data_path(value: str) -> Path:
    """``--data``'s value. An empty one (``--data "$DIR"`` with DIR unset) is refused rather than
    read as the current directory, which would then receive the conversations and token hashes."""
    if not value.strip():
        raise typer.BadParameter("is empty: name a directory (or leave the flag out)")
    return Path(value)


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="provider:model (default: $AGENTLOOP_MODEL, the config file, the embedded model)"
    ),
]
WorkspaceOpt = Annotated[
    Path | None,
    typer.Option("--workspace", "-w", help="Directory the file and shell tools work in (default: current directory)"),
]
SystemOpt = Annotated[str | None, typer.Option("--system", help="System prompt.")]
DataOpt = Annotated[
    Path | None,
    typer.Option(
        "--data",
        parser=data_path,
        help="Where the database and files live (default: $AGENTLOOP_DATA, $XDG_DATA_HOME/agentloop, "
        "~/.local/share/agentloop).",
    ),
]
StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        help="Store URL: sqlite:///path or postgresql://user@host/db, which several servers may share "
        "(default: $AGENTLOOP_STORE, the config file's store, <data>/agentloop.db).",
    ),
]

_LIMITS = "Run limits"
MaxRoundsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-rounds",
        metavar="N",
        help="Model rounds with tools per run (config: max_rounds).",
        rich_help_panel=_LIMITS,
    ),
]
MaxToolCallsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-tool-calls", metavar="N", help="Tool calls per run (config: max_tool_calls).", rich_help_panel=_LIMITS
    ),
]
MaxWallClockOpt = Annotated[
    float | None,
    typer.Option(
        "--max-wall-clock",
        metavar="SECONDS",
        help="Seconds a run may take (config: max_wall_clock).",
        rich_help_panel=_LIMITS,
    ),
]
MaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-tokens",
        metavar="N",
        help="Input and output tokens a run may use, over all its model calls (config: max_tokens).",
        rich_help_panel=_LIMITS,
    ),
]
MaxCostOpt = Annotated[
    float | None,
    typer.Option(
        "--max-cost",
        metavar="DOLLARS",
        help="Dollars a run may cost, at catalog prices (config: max_cost).",
        rich_help_panel=_LIMITS,
    ),
]
FallbackOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fallback",
        metavar="MODEL",
        help="provider:model to switch to when the model keeps failing; repeat for more, tried in order "
        "(config: fallbacks = [...]).",
        rich_help_panel=_LIMITS,
    ),
]
CompactionOpt = Annotated[
    float | None,
    typer.Option(
        "--compaction-threshold",
        metavar="SHARE",
        help="Summarise older history once the context window is this full, 0-1 (default 0.9; "
        "config: compaction_threshold).",
        rich_help_panel=_LIMITS,
    ),
]


ReasoningOpt = Annotated[
    str | None,
    typer.Option(
        "--reasoning",
        metavar="LEVEL",
        help="How hard a reasoning model thinks: off, minimal, low, medium, high or xhigh (default: the "
        "model's own; config: reasoning).",
        rich_help_panel=_LIMITS,
    ),
]
MaxConcurrencyOpt = Annotated[
    int | None,
    typer.Option(
        "--max-concurrency",
        metavar="N",
        help="Tool calls of one model turn that run at once (default 16; config: max_concurrency).",
        rich_help_panel=_LIMITS,
    ),
]
ToolExecutionOpt = Annotated[
    str | None,
    typer.Option(
        "--tool-execution",
        metavar="MODE",
        help="parallel (default) or sequential: a turn's tool calls one after the other (config: tool_execution).",
        rich_help_panel=_LIMITS,
    ),
]
# the chat-app commands' (telegram, whatsapp, discord): a person answers in the app
ChannelApprovalOpt = Annotated[
    str,
    typer.Option(
        "--approval",
        help="Tool calls: ask (default policy: risky calls wait for Approve/Deny buttons in the conversation), "
        "auto, deny, or a JSON policy.",
    ),
]

_VOICE = "Voice messages"
# the chat-app commands': voice messages and audio files become text (refused without a model)
TranscribeModelOpt = Annotated[
    str | None,
    typer.Option(
        "--transcribe-model",
        metavar="PROVIDER:MODEL",
        envvar="AGENTLOOP_TRANSCRIBE_MODEL",
        show_envvar=False,
        help="Take voice messages and audio files, transcribed by this model: openai:whisper-1, or openai:<id> "
        "of any server speaking OpenAI's /v1/audio/transcriptions (with --transcribe-url); key from "
        "$OPENAI_API_KEY. Default: $AGENTLOOP_TRANSCRIBE_MODEL; without one, voice messages are refused.",
        rich_help_panel=_VOICE,
    ),
]
TranscribeUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--transcribe-url",
        metavar="URL",
        envvar="AGENTLOOP_TRANSCRIBE_URL",
        show_envvar=False,
        help="The transcription server's base URL (default: $AGENTLOOP_TRANSCRIBE_URL, $OPENAI_BASE_URL, OpenAI); "
        "a server of your own needs no key.",
        rich_help_panel=_VOICE,
    ),
]
TranscribeKeyEnvOpt = Annotated[
    str | None,
    typer.Option(
        "--transcribe-key-env",
        metavar="NAME",
        help="The environment variable that holds the transcription server's API key (default: OPENAI_API_KEY).",
        rich_help_panel=_VOICE,
    ),
]


def loop_flags(
    max_rounds: int | None = None,
    max_tool_calls: int | None = None,
    max_wall_clock: float | None = None,
    max_tokens: int | None = None,
    max_cost: float | None = None,
    fallback: list[str] | None = None,
    compaction_threshold: float | None = None,
    reasoning: str | None = None,
    *,
    max_concurrency: int | None = None,
    tool_execution: str | None = None,
) -> LoopFlags:
    """The run-limit flags as one value (an empty ``--fallback`` list means the flag was not given).
    How a turn's tool calls run is keyword-only: the commands without those flags pass none."""
    return LoopFlags(
        max_rounds=max_rounds,
        max_tool_calls=max_tool_calls,
        max_wall_clock=max_wall_clock,
        max_tokens=max_tokens,
        max_cost=max_cost,
        fallbacks=tuple(fallback) if fallback else None,
        compaction_threshold=compaction_threshold,
        reasoning=reasoning,  # type: ignore[arg-type]  # (checked with the other flags: _flag_errors)
        max_concurrency=max_concurrency,
        tool_execution=tool_execution,  # type: ignore[arg-type]  # (likewise)
    )
