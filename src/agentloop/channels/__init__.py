"""Chat channels: a person talks to their durable agent from a messaging app.

Each channel is a bridge between one app's bot API and a ``Kernel``: it turns the app's incoming
messages into ``Process.send``, and the process's signals (answers, approval requests) into the
app's outgoing messages. ``telegram`` (long-polling; ``botapi`` is its HTTP client), ``whatsapp``
(a webhook; ``graph`` is its HTTP client) and ``discord`` (a gateway WebSocket; ``discord_api`` is
its HTTP client) share their process handling in ``bridge``.
"""
