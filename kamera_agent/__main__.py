"""``python -m kamera_agent`` is the ``kamera`` command."""

from kamera_agent.cli import main

raise SystemExit(main())
