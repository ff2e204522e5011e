"""The conformance fixtures (one store per dialect) for every file of this suite."""

from tests.store_conformance.test_conformance import make_store, store  # noqa: F401
