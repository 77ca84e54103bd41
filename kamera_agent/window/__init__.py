"""The window: a deque of chunks edited by rotation and patches, planned by an antecedent graph."""

from kamera_agent.window.state import ChunkRef
from kamera_agent.window.window import KameraWindow

__all__ = ["ChunkRef", "KameraWindow"]
