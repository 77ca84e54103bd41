"""The shipped demo model (kamera-tiny-vl), its synthetic binding task, and ``kamera demo``."""

from kamera_agent.demo.model import DEMO_MODEL_DIR, load_demo_model

__all__ = ["DEMO_MODEL_DIR", "load_demo_model"]
