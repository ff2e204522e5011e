"""Devices: a machine that connects to an agentloop server and lends it its tools (DESIGN §4).

``agentloop device connect URL --token T`` runs ``DeviceClient``; the server's side is
``agentloop.server.devices.DeviceHub``.
"""
