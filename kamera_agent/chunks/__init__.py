"""Chunks: what an agent admits (images, frames, screenshots, pages, text), prepared for a model."""

from kamera_agent.chunks.chunk import Chunk, ChunkKind, content_key
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.positions import LinearPositions, PositionScheme
from kamera_agent.chunks.prompt import PromptFormat
from kamera_agent.chunks.sources import Text, VideoFrame, document_pages, read_video, to_rgb_image

__all__ = [
    "Chunk",
    "ChunkEncoder",
    "ChunkKind",
    "LinearPositions",
    "PositionScheme",
    "PromptFormat",
    "Text",
    "VideoFrame",
    "content_key",
    "document_pages",
    "read_video",
    "to_rgb_image",
]
