"""Demos run by ``kamera demo``."""
