"""Worked examples of new algorithms built on the hooks (docs/new_algorithm.md); each is fitted through the CLI
by the test suite (``tests/test_examples.py``)."""
