"""Chat channels: a person talks to their durable agent from a messaging app.

Each channel is a bridge between one app's bot API and a ``Kernel``: it turns the app's incoming
messages into ``Process.send``, and the process's signals (answers, approval requests) into the
app's outgoing messages. ``telegram`` is the first; ``botapi`` is its HTTP client.
"""
