"""``agentloop device connect URL --token T``: lend this machine's files (and, when asked, its
shell) to a server; ``agentloop device token NAME``: issue (or ``--revoke``) the token it connects
with, a device token bound to that one device name (the server refuses an account token for a
device unless started with ``--device-account-tokens``); ``agentloop device forget NAME``: remove a
device from the account's registry, freeing its place.

By default a device lends only reading and searching files under ``--root``. Writing, editing and
deleting files (``--allow fs``) and running commands (``--allow shell``: remote command execution on
this machine, by whatever the account's agents decide) must be asked for explicitly.

Kept apart from ``cli/main.py`` so the device needs neither the model stack nor the server; the
``websockets`` library (the ``server`` extra) is imported only when connecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from agentloop.cli.options import ServerOpt, TokenOpt
from agentloop.cli.usage import App
from agentloop.device.client import (
    DEFAULT_ALLOW,
    DeviceClient,
    DeviceError,
    DeviceOptions,
    default_name,
    parse_allow,
    websocket_url,
)
from agentloop.urls import check_token, redact_url

device_app = App(
    name="device",
    help="Connect this machine to an agentloop server as a device.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@device_app.callback()
def _device() -> None:
    """Connect this machine to an agentloop server as a device."""


def _say(text: str) -> None:
    # (after SIGHUP the terminal may be gone: a line nobody can read must not stop the shutdown)
    with contextlib.suppress(OSError, ValueError):
        print(f"agentloop device: {text}", file=sys.stderr, flush=True)


#: What asks a device to stop: Ctrl-C, ``kill``, and the terminal it runs in closing (SIGHUP, whose
#: default action would end the device at once and leave its shell commands, each in a session of
#: its own, running with nobody to stop them). A SIGHUP that is ignored (``nohup``) stays ignored.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


async def _serve(client: DeviceClient) -> None:
    """Run the client until it fails fatally or SIGINT / SIGTERM / SIGHUP asks it to stop (cleanly:
    running work is cancelled, shell process groups killed, the socket closed)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        if sig not in (signal.SIGINT, signal.SIGTERM) and signal.getsignal(sig) is signal.SIG_IGN:
            continue  # set aside by whoever started us (nohup): theirs to decide
        loop.add_signal_handler(sig, stop.set)
    runner = asyncio.create_task(client.run())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not runner.done():
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        _say("stopped")
        return
    runner.result()  # DeviceError, or anything unexpected


@device_app.command("connect")
def connect(
    url: Annotated[
        str, typer.Argument(metavar="URL", help="The server, e.g. http://host:8765 (or ws://host:8765/v1/ws).")
    ],
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=["AGENTLOOP_DEVICE_TOKEN", "AGENTLOOP_TOKEN"],
            help="The device's token, from 'agentloop device token NAME' (or AGENTLOOP_DEVICE_TOKEN, AGENTLOOP_TOKEN).",
            show_default=False,
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", help="The device id, the NAME its token was issued for (default: the host name)."),
    ] = None,
    description: Annotated[
        str, typer.Option("--description", help="What the device is, for the agents (e.g. 'my laptop, has the GPU').")
    ] = "",
    root: Annotated[Path | None, typer.Option("--root", help="The directory it serves (default: here).")] = None,
    allow: Annotated[
        str,
        typer.Option(
            "--allow",
            help="What it lends, comma-separated: read (read and search files: the default), fs (also write, "
            "edit and delete them), shell (run commands on this machine: only if you mean it), or syscall "
            "names such as fs.read.",
        ),
    ] = "read",
    backoff: Annotated[float, typer.Option("--backoff", help="First reconnect delay, seconds.", hidden=True)] = 1.0,
    backoff_max: Annotated[float, typer.Option("--backoff-max", help="Longest reconnect delay.", hidden=True)] = 60.0,
) -> None:
    """Connect as a device and serve requests inside --root until stopped. It lends only reading
    and searching files unless --allow says more: --allow fs,shell also lets the server's agents
    change files and run commands here."""
    try:
        if not token:
            raise ValueError("a token is needed: --token T or AGENTLOOP_TOKEN")
        check_token(token)
        target = websocket_url(url)
        implements = parse_allow(allow)
        base = (root or Path.cwd()).expanduser().resolve()
        if not base.is_dir():
            raise ValueError(f"--root {str(base)!r} is not a directory")
    except ValueError as exc:
        _say(f"error: {exc}")
        raise typer.Exit(2) from None
    options = DeviceOptions(
        url=target,
        token=token,
        name=name or default_name(),
        root=base,
        implements=implements,
        description=description,
        backoff_initial=max(0.01, backoff),
        backoff_max=max(backoff, backoff_max),
    )
    # (the address may carry a proxy's password: the terminal, and the log that keeps it, get it masked)
    _say(f"serving {base} ({', '.join(implements)}) as {options.name}; connecting to {redact_url(target)}")
    if "shell.exec" in implements:
        _say("shell lent: the account's agents can run commands on this machine as you")
    elif implements == DEFAULT_ALLOW:
        _say("read-only; --allow fs,shell to let agents change files and run commands")
    try:
        asyncio.run(_serve(DeviceClient(options, say=_say)))
    except DeviceError as exc:
        _say(f"error: {exc}")
        raise typer.Exit(1) from None
    except ModuleNotFoundError as exc:
        if os.environ.get("AGENTLOOP_DEBUG"):
            raise
        _say(f"error: {exc.name} is missing: pip install 'agentloop[server]'")
        raise typer.Exit(1) from None


@device_app.command("token")
def token_command(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The device's name (its --name when it connects).")],
    revoke: Annotated[bool, typer.Option("--revoke", help="Revoke its token instead (its connection closes).")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Issue the token device NAME connects with, printed once (a token issued before for it stops
    working), or --revoke it. Asked of the server with an account token, as the client commands are."""
    from agentloop.cli.client import call
    from agentloop.cli.main import _guarded

    with _guarded():
        if revoke:
            call(server, token, lambda client: client.revoke_device_token(name))
            typer.echo(f"revoked the token of device {name}")
            return
        issued = call(server, token, lambda client: client.device_token(name))
        typer.echo(issued["token"])
        _say(
            f"the token of device {name}, shown only this once (one issued before no longer works); "
            f"connect with: agentloop device connect URL --name {name} --token TOKEN"
        )


@device_app.command("forget")
def forget_command(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The device's name.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Forget device NAME: its registry entry and token go, freeing its place among the account's
    devices, and its connection closes. Unlike --revoke, the device is no longer listed."""
    from agentloop.cli.client import call
    from agentloop.cli.main import _guarded

    with _guarded():
        call(server, token, lambda client: client.forget_device(name))
        typer.echo(f"forgot device {name}")


if __name__ == "__main__":  # ``python -m agentloop.cli.device connect …``: the device alone, quick to start
    device_app()
