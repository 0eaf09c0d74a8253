"""kvferry.pools."""
