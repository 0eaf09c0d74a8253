"""kvferry.kernels."""
