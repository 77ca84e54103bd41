"""``kamera bench --suite agents``: four agents' window scripts, kamera against a prefix cache.

- `script`: an agent as data (ops per step, the lineup each step leaves), built before timing;
- `contents`: what the agents push (random-token chunks, or the demo task's rendered frames);
- `scripts`: the agents (stream, video, web, document) and their sizes;
- `sides`: kamera windows and the prefix cache, each running a step and timing it;
- `run`: the side-by-side loop and its checks; `records`: what it measured;
- `ttft`: time to first token after window ops on a long window, against its floor;
- `report`, `plots`: tables, claims and plots; `profile`: cProfile of kamera's side of one agent.
"""

from kamera_agent.bench.agents.records import SIDES, AgentRun, AgentsRun
from kamera_agent.bench.agents.scripts import AGENTS, AgentCounts

__all__ = ["AGENTS", "SIDES", "AgentCounts", "AgentRun", "AgentsRun"]
