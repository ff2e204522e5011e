"""Shared test configuration. Provider fakes live in ``tests/fakes``."""
