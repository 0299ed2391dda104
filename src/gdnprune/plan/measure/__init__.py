"""Measuring the candidates: the grids of every block and their exact costs, the problem as data, and the
sensitivities (one block cut at a time, successive halving, blockwise local distillation, whole cut
models, latency)."""
