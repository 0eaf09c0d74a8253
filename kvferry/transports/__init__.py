"""kvferry.transports."""
