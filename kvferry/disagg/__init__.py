"""Disaggregated serving: a context engine hands each request's whole cache to a generation engine."""
