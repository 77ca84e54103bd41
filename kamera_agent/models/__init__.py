"""Model-side assets that kamera-agent builds itself, offline: tokenizers and small demo models."""
