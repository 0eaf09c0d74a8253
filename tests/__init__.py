"""kvferry's test suite."""
