"""``kamera serve``: an OpenAI-compatible chat server whose requests become window edits.

`KameraServer` decides what a request costs (session, sync, answer, usage); `create_app` puts
it behind HTTP; `sync_window` is the request-to-window diff; `read_turns` reads messages.
"""

from kamera_agent.moved import renamed
from kamera_agent.serve.fetch import ImageFetching
from kamera_agent.serve.media import MediaAccess
from kamera_agent.serve.server import Completion, KameraServer, ServeSettings
from kamera_agent.serve.sync import SyncReport, sync_window
from kamera_agent.serve.turns import Limits, read_turns

__all__ = [
    "Completion",
    "ImageFetching",
    "KameraServer",
    "Limits",
    "MediaAccess",
    "ServeSettings",
    "SyncReport",
    "read_turns",
    "sync_window",
]

__getattr__ = renamed(__name__, {"MediaPolicy": "MediaAccess"})
"""The old name of `MediaAccess` lasts a release."""
