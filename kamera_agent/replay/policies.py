"""Real agents' context policies: what each sends the model at every step.

Each is read from the agent's own code (`Policy.source` names whose); the replay renders one agent
loop under each: a task, then per step the agent's action (scripted, so every side of a
comparison sees the same conversation) and the new screen or tool output.

- ``keep-3-batched``: Anthropic's computer-use demo keeps the last 3 screenshots and removes
  older ones in batches of 10 "to reduce the amount we break the implicit prompt cache"
  (``_maybe_filter_to_n_most_recent_images``, ``min_removal_threshold=10``).
- ``current-only``: browser-use sends only the current screenshot; history is text.
- ``latest-8``: Agent-S3 keeps the latest 8 screenshots (older messages keep their text).
- ``latest-5-spliced``: UI-TARS-desktop keeps 5 screenshots and splices the older actions into
  the first message as text, so the conversation's start changes every step.
- ``tool-truncated``: a tool-using agent truncates tool outputs older than 3 steps to a stub
  (cloudflare/agents, local-operator); each request ends in the newest tool output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kamera_agent.replay.screens import Screens

__all__ = ["POLICIES", "Messages", "Policy"]

Messages = list[dict[str, Any]]
SYSTEM: dict[str, Any] = {"role": "system", "content": "You operate a computer. Reply with the next action."}
TASK = "Book a table for two at eight."


@dataclass(frozen=True)
class Policy:
    """A context policy: its name, whose it is, and the request it sends at each step."""

    name: str
    source: str
    request: Callable[[Screens, int], Messages]

    def requests(self, screens: Screens, steps: int) -> list[Messages]:
        return [self.request(screens, step) for step in range(steps)]


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _screens_then_drop(screens: Screens, step: int, newest: int, batch: int) -> Messages:
    """Screens after every action; the oldest screens dropped (their text kept) once more than
    ``newest``, ``batch`` at a time."""
    messages: Messages = [SYSTEM, {"role": "user", "content": [_text(TASK), screens.screen(0)]}]
    shown = [(1, 1)]  # (message, part) of each screen, oldest first
    for k in range(step):
        messages.append({"role": "assistant", "content": screens.action(k)})
        messages.append({"role": "user", "content": [screens.screen(k + 1), _text(f"step {k + 1}")]})
        shown.append((len(messages) - 1, 0))
    drop = len(shown) - newest
    drop -= drop % batch
    for m, p in reversed(shown[: max(0, drop)]):
        del messages[m]["content"][p]
    return messages


def _newest_3_batched(screens: Screens, step: int) -> Messages:
    return _screens_then_drop(screens, step, newest=3, batch=10)


def _latest_8(screens: Screens, step: int) -> Messages:
    return _screens_then_drop(screens, step, newest=8, batch=1)


def _current_only(screens: Screens, step: int) -> Messages:
    messages: Messages = [SYSTEM, {"role": "user", "content": TASK}]
    for k in range(step):
        messages.append({"role": "assistant", "content": screens.action(k)})
        messages.append({"role": "user", "content": f"step {k + 1}: {screens.action(k)} done"})
    messages.append({"role": "user", "content": [screens.screen(step), _text(f"now: step {step}")]})
    return messages


def _latest_5_spliced(screens: Screens, step: int, newest: int = 5) -> Messages:
    first = max(0, step - newest + 1)
    history = "; ".join(screens.action(k) for k in range(first))
    task = TASK + (f"\nPrevious actions: {history}" if history else "")
    messages: Messages = [SYSTEM, {"role": "user", "content": task}]
    for k in range(first, step + 1):
        if k > first:
            messages.append({"role": "assistant", "content": screens.action(k - 1)})
        messages.append({"role": "user", "content": [screens.screen(k)]})
    return messages


def _tool_truncated(screens: Screens, step: int, newest: int = 3) -> Messages:
    messages: Messages = [SYSTEM, {"role": "user", "content": TASK}]
    for k in range(step + 1):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "act", "arguments": json.dumps({"action": screens.action(k)})},
        }
        output = screens.output(k) if k > step - newest else "(output dropped)"
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": output})
    return messages


POLICIES = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            Policy("keep-3-batched", "Anthropic computer-use demo", _newest_3_batched),
            Policy("current-only", "browser-use", _current_only),
            Policy("latest-8", "Agent-S3", _latest_8),
            Policy("latest-5-spliced", "UI-TARS-desktop", _latest_5_spliced),
            Policy("tool-truncated", "tool agents (cloudflare/agents)", _tool_truncated),
        )
    }
)
"""The replayed policies, in the order the suite runs them."""
