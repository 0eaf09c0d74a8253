"""kvferry.engine."""
