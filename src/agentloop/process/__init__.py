"""Durable processes: conversations whose state lives in a store and survives a crash."""
