"""Structured output: ``response_format`` JSON and required tool calls, enforced token by token
with llguidance.

Why llguidance: the grammar engine vLLM and SGLang use (with xgrammar) to mask logits, as a
3 MB wheel with no dependencies (xgrammar pulls in triton). A JSON schema (or "any JSON
object") is compiled once per request into a grammar with **no flexible whitespace**, so even a
small model cannot wander into an endless run of spaces: every token it may choose keeps the
text a prefix of a valid document, and the answer ends when the document is complete. The mask
is computed on the CPU and applied to the logits wherever they live.

A required tool call (``tool_choice`` ``required`` or a named function) is the same machinery
over a grammar of the template family's call text (Hermes: ``<tool_call>\n{"name": …,
"arguments": …}\n</tool_call>``; Llama 3: a bare ``{"name": …, "parameters": …}``) with the
name one of the allowed functions and the arguments that function's parameter schema, spaced
as the template renders calls (``json.dumps``'s ``": "`` and ``", "``), so a forced call reads
exactly like one the model chose.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from kamera_agent.backends.base import Constraint
from kamera_agent.serve.bounds import SchemaBound
from kamera_agent.serve.protocol import ChatRequest, RequestError
from kamera_agent.serve.tools import ToolFormat

__all__ = ["Constraints", "Grammar", "json_constraint", "tool_call_constraint"]

_RENDERED_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""How a call's JSON is spaced: as the template renders calls (``json.dumps``), and no more."""


class Grammar:
    """A compiled grammar for one tokenizer; each `Constraint` it makes follows one answer."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance  # not llguidance.torch: it torch.compile s a kernel at import

        self._llg = llguidance
        self.tokenizer, self.grammar = tokenizer, grammar

    def __call__(self) -> Constraint:
        return _Follower(self)


class _Follower:
    def __init__(self, grammar: Grammar) -> None:
        self.matcher = grammar._llg.LLMatcher(grammar.tokenizer, grammar.grammar)
        self.size = int(grammar.tokenizer.vocab_size)

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        size = min(self.size, int(scores.shape[-1]))
        allowed = _unpack(words, size).to(scores.device)
        out = torch.full_like(scores, float("-inf"), dtype=torch.float32)
        out[:size][allowed] = scores[:size][allowed].float()
        return out

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())


def _unpack(words: torch.Tensor, size: int) -> torch.Tensor:
    """The allowed-token mask ``[size]`` (bool) from llguidance's packed 32-bit words."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (words.to(torch.int32).unsqueeze(-1) >> bits) & 1
    return unpacked.flatten()[:size].bool()


class Constraints:
    """What a request's answer is held to, for one served model: a required tool call, a JSON
    format, or nothing; every schema checked against ``bound`` before it is compiled.

    Args:
        tokenizer: the served model's (read by llguidance on the first structured request).
        tool_format: how the model's template writes tool calls.
        bound: how large a schema may be.
    """

    def __init__(self, tokenizer: Any, tool_format: ToolFormat, bound: SchemaBound) -> None:
        self.tokenizer, self.tool_format, self.bound = tokenizer, tool_format, bound
        self._llg: Any = None

    def of(self, request: ChatRequest) -> Callable[[], Constraint] | None:
        """The constraint ``request`` asks for (``None``: free text).

        Raises:
            RequestError: a schema over the bound, or one that does not compile.
        """
        forced = request.forced_tools
        if forced is not None:
            return tool_call_constraint(
                self._grammar_tokenizer(),
                forced,
                self.tool_format,
                parallel=request.parallel_tool_calls,
                bound=self.bound,
            )
        if (request.response_format or {}).get("type", "text") != "text":
            return json_constraint(self._grammar_tokenizer(), request.response_format or {}, self.bound)
        return None

    def _grammar_tokenizer(self) -> Any:
        if self._llg is None:
            import llguidance.hf

            self._llg = llguidance.hf.from_tokenizer(self.tokenizer)
        return self._llg


def json_constraint(
    tokenizer: Any, response_format: dict[str, Any], bound: SchemaBound
) -> Callable[[], Constraint] | None:
    """The constraint ``response_format`` asks for (``None`` for text).

    Args:
        tokenizer: an ``llguidance.LLTokenizer`` of the served model.
        bound: how large the schema may be (checked before it is compiled).

    Raises:
        RequestError: a format or schema that is not served, is over ``bound`` or does not compile.
    """
    import llguidance

    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(
                400, "response_format json_schema needs json_schema.schema", param="response_format"
            )
        bound.check(schema, "response_format.json_schema.schema", "response_format")
    else:
        raise RequestError(400, f"response_format {str(kind)[:40]!r} is not served", param="response_format")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except Exception as exc:  # the compiler's own message names what it cannot take
        raise RequestError(400, f"response_format schema: {exc}"[:300], param="response_format") from exc
    return _compiled(tokenizer, grammar, "response_format schema", "response_format")


def tool_call_constraint(
    tokenizer: Any,
    functions: list[dict[str, Any]],
    tool_format: ToolFormat,
    *,
    parallel: bool,
    bound: SchemaBound,
) -> Callable[[], Constraint]:
    """The constraint of a required tool call: one call (or, with ``parallel``, one or more) of
    one of ``functions`` (OpenAI function objects: ``name``, ``parameters``), in
    ``tool_format``'s text.

    Raises:
        RequestError: parameter schemas over ``bound`` together, or one that does not compile.
    """
    import llguidance

    bound.check(
        [function.get("parameters") for function in functions], "tools[].function.parameters", "tools"
    )

    rules = []
    for i, function in enumerate(functions):
        parameters = function.get("parameters") or {"type": "object"}
        schema = {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, tool_format.arguments_key: parameters},
            "required": ["name", tool_format.arguments_key],
            "additionalProperties": False,
            "x-guidance": _RENDERED_JSON,
        }
        rules.append(f"f{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    alternatives = f"({' | '.join(f'f{i}' for i in range(len(functions)))})"
    framed = [_literal(tool_format.open) if tool_format.open else "", alternatives]
    framed.append(_literal(tool_format.close) if tool_format.close else "")
    call = " ".join(piece for piece in framed if piece)
    more = f" ({_literal(tool_format.separator)} call)*" if parallel else ""
    lark = "\n".join([f"start: call{more}", f"call: {call}", *rules]) + "\n"
    try:
        grammar = llguidance.grammar_from("lark", lark)
    except Exception as exc:
        raise RequestError(400, f"tool parameters: {exc}"[:300], param="tools") from exc
    return _compiled(tokenizer, grammar, "tool parameters", "tools")


def _literal(text: str) -> str:
    """``text`` as a lark string literal (JSON's escapes are lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _compiled(tokenizer: Any, grammar: str, what: str, param: str) -> Grammar:
    import llguidance

    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)  # "" when it compiles
    if message:
        raise RequestError(400, f"{what}: {message}"[:300], param=param)
    return Grammar(tokenizer, grammar)
