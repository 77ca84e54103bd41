"""Screens for a text model: accessibility-tree text, generated from a seed, fitted to a length.

Why accessibility trees: a computer-use agent that serves a text model reads the screen as the
platform's accessibility tree (roles, names, states, one node a line, nested by indentation),
not as pixels; such a tree is what its screenshots cost in tokens. The trees here are plausible
UI screens (a banner, navigation, a main region with a form, a list or a table, sometimes a
dialog) drawn deterministically from ``(seed, index)``, so every side of a comparison and every
rerun sees the same screens. The lines go on forever: whoever uses them stops at the length it
wants, counted by the model's own tokenizer (`kamera_agent.bench.agents.text_contents`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

__all__ = ["caption_words", "screen_lines", "screen_title", "transcript_words"]

_APPS = (
    ("Orders", "Shop"),
    ("Inbox", "Mail"),
    ("Bookings", "Table for two"),
    ("Settings", "Account"),
    ("Issues", "Tracker"),
    ("Calendar", "Team"),
    ("Invoices", "Billing"),
    ("Files", "Drive"),
)
_VOCABULARY = (
    "address city postcode country phone email name surname company notes delivery payment card "
    "expiry total subtotal discount coupon quantity size colour date time guests table window "
    "terrace status priority assignee label comment reply forward archive draft folder invoice "
    "amount currency tax reference project owner shared modified size version branch"
)
_WORDS = _VOCABULARY.split()
_FIELDS = ("textbox", "combobox", "checkbox", "radio", "switch", "spinbutton", "slider")
_STATES = ("focusable", "required", "disabled", "expanded=false", "selected", "readonly", "invalid=false")


def screen_lines(seed: int, index: int) -> Iterator[str]:
    """The ``index``-th screen of ``seed``, node by node: its title line, then a node a line,
    region after region, forever (a long screen scrolls on; the caller stops at its length)."""
    rng = random.Random(f"a11y:{seed}:{index}")
    yield screen_title(seed, index)
    yield from _nodes(rng)


def screen_title(seed: int, index: int) -> str:
    """The screen's first line: its window, app and step (also what a caption of it says)."""
    page, app = _APPS[random.Random(f"a11y-title:{seed}:{index}").randrange(len(_APPS))]
    return f'window "{page} - {app}" (screen {index + 1}) focused'


def _nodes(rng: random.Random) -> Iterator[str]:
    """Node lines, one region after another, forever (a long screen scrolls on)."""
    yield "  banner"
    yield f'    link "{_label(rng)}" focusable'
    yield f'    search "Search {rng.choice(_WORDS)}" value=""'
    yield '  navigation "Main"'
    for _ in range(rng.randint(3, 6)):
        current = " current=page" if rng.random() < 0.2 else ""
        yield f'    link "{_label(rng)}"{current}'
    while True:
        yield from _region(rng)


def _region(rng: random.Random) -> Iterator[str]:
    kind = rng.choice(("form", "list", "table", "dialog", "article"))
    yield f'  {"main" if kind != "dialog" else "dialog"} "{_label(rng)}"'
    yield f'    heading "{_label(rng)}" level={rng.randint(1, 3)}'
    if kind == "form":
        for _ in range(rng.randint(3, 7)):
            role = rng.choice(_FIELDS)
            value = f' value="{rng.choice(_WORDS)} {rng.randint(1, 99)}"' if role != "checkbox" else ""
            state = f" {rng.choice(_STATES)}" if rng.random() < 0.5 else ""
            checked = f" checked={rng.choice(('true', 'false'))}" if role in ("checkbox", "radio") else ""
            yield f'    {role} "{_label(rng)}"{value}{checked}{state}'
        yield f'    button "{_label(rng)}" focusable'
    elif kind == "list":
        yield f'    list "{_label(rng)}" items={rng.randint(4, 40)}'
        for _ in range(rng.randint(3, 6)):
            yield f'      listitem "{_label(rng)}, {rng.randint(1, 28)} {rng.choice(_WORDS)}"'
            yield f'        button "{rng.choice(("Open", "Edit", "Remove", "Share"))}" focusable'
    elif kind == "table":
        columns = [_label(rng) for _ in range(rng.randint(3, 5))]
        yield f'    table "{_label(rng)}" rows={rng.randint(5, 60)}'
        yield "      row " + " ".join(f'columnheader "{c}"' for c in columns)
        for _ in range(rng.randint(2, 4)):
            cells = " ".join(f'cell "{rng.choice(_WORDS)} {rng.randint(1, 999)}"' for _ in columns)
            yield f"      row {cells}"
    else:
        for _ in range(rng.randint(2, 4)):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14)))
            yield f'    statictext "{words.capitalize()}."'
        yield f'    button "{rng.choice(("OK", "Cancel", "Close", "Continue"))}" focusable'


def _label(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
    return " ".join(words).capitalize()


def transcript_words(seed: int, index: int) -> Iterator[str]:
    """The ``index``-th transcript line of ``seed``: the action taken on a node of the screen, then
    what it led to, a word at a time (the caller stops at the line's length)."""
    rng = random.Random(f"a11y-line:{seed}:{index}")
    role = rng.choice(("button", "link", "textbox", "checkbox", "combobox", "tab", "menuitem"))
    verb = {"textbox": "type", "combobox": "select", "checkbox": "check"}.get(role, "click")
    yield f'step {index + 1}: {verb} {role} "{_label(rng)}" ->'
    while True:
        yield rng.choice(_WORDS)


def caption_words(seed: int, index: int) -> Iterator[str]:
    """What replaces screen ``index`` of ``seed`` once it is dropped: its title, then a word at a
    time of what it showed."""
    rng = random.Random(f"a11y-caption:{seed}:{index}")
    yield f"(closed) {screen_title(seed, index)}, showing"
    while True:
        yield rng.choice(_WORDS)
