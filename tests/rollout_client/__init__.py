"""Tests of the Python client library."""
