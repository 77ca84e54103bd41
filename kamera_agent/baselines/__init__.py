"""Baselines kamera is measured against, below both the benchmarks and the demo that run them.

Why a package of its own: the demo plays an episode beside the prefix cache and the benchmarks
time it; neither may reach up into the other, so the baseline lives where both reach it from
below.
"""
