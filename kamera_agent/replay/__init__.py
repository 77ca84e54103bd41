"""``kamera bench --suite agents-replay``: real agents' context policies replayed through
``kamera serve`` with the official client, beside the same server as a prefix cache.

Why a package above the server: it drives the server as an agent does (HTTP, the openai
client, the messages each policy sends), so it sits above `kamera_agent.serve`; the ``kamera``
command dispatches to it.
"""

from kamera_agent.replay.policies import POLICIES, Policy
from kamera_agent.replay.run import ReplayRun, run_replay

__all__ = ["POLICIES", "Policy", "ReplayRun", "run_replay"]
