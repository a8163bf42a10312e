"""OpenAI chat messages ↔ the policy's tokens, and the OpenAI response bodies (pure functions).

A request's messages become prompt tokens through the tokenizer's chat template (with the
request's ``tools``), or, for a tokenizer without one (the tiny CPU model), through the plain
template the built-in tool workflow uses::

    user/system text  ·  assistant text + its tool call as the model writes it  ·  tool: "=<output>="

so an agent behind the gateway sees exactly what a ``ToolWorkflow`` episode shows the model. A
completion's text becomes an assistant message: the text before the first tool call is its
``content``, that call its ``tool_calls`` (``finish_reason: "tool_calls"``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..agent.tools import ToolCall, call_text, first_call_span, parse_tool_calls
from ..agent.workflow import TOOL_MESSAGE
from ..api.base import shown
from ..inference.contract import FINISH_LENGTH, MAX_PROMPT_TOKENS
from ..models.text import TextCodec
from .params import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_ARGUMENT_DEPTH = 32  # nesting of a tool call's arguments (objects and lists): deeper is refused, 400
FINISH_TOOL_CALLS = "tool_calls"


def content_text(content: Any, where: str) -> str:
    """A message's ``content``: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for n, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{n}]: only text parts are supported", f"{where}[{n}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}: must be a string, null or a list of text parts", where)


def tool_calls(message: dict[str, Any], where: str) -> list[ToolCall]:
    """The ``tool_calls`` of an assistant message, as parsed calls (arguments as objects)."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls: must be a list", f"{where}.tool_calls")
    out = []
    for n, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise RequestError(f"{where}.tool_calls[{n}].function.name: required", f"{where}.tool_calls[{n}]")
        arguments = function.get("arguments") or {}
        field = f"{where}.tool_calls[{n}].function.arguments"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as err:
                raise RequestError(f"{field}: not JSON (or nested too deeply)", field) from err
        if not isinstance(arguments, dict):
            raise RequestError(f"{field}: must be an object", field)
        if nesting(arguments) > MAX_ARGUMENT_DEPTH:
            raise RequestError(f"{field}: nested more than {MAX_ARGUMENT_DEPTH} levels deep", field)
        out.append(ToolCall(name, arguments))
    return out


def nesting(value: Any) -> int:
    """How deeply ``value``'s objects and lists nest (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            level.extend((child, depth + 1) for child in children)
    return deepest


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` with known roles, each tool message answering a call an earlier assistant message made
    (its ``tool_call_id``, as OpenAI's API requires); a RequestError naming the message otherwise."""
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise RequestError(f"messages: a list of 1 to {MAX_MESSAGES} messages is required", "messages")
    called: set[str] = set()
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{n}].role: must be one of {', '.join(ROLES)}", f"messages[{n}]")
        if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
            called |= {c["id"] for c in message["tool_calls"] if isinstance(c, dict) and isinstance(c.get("id"), str)}
        if message["role"] == "tool" and not (isinstance(tid := message.get("tool_call_id"), str) and tid in called):
            raise RequestError(f"messages[{n}].tool_call_id: {shown(tid)} answers no tool "
                               "call of an earlier assistant message", f"messages[{n}].tool_call_id")
    return messages


def plain_text(messages: list[dict[str, Any]]) -> str:
    """The plain template (module docstring)."""
    out = []
    for n, message in enumerate(messages):
        text = content_text(message.get("content"), f"messages[{n}].content")
        if message["role"] == "tool":
            out.append(TOOL_MESSAGE.format(text))
        elif message["role"] == "assistant":
            out.append(text + "".join(call_text(c) for c in tool_calls(message, f"messages[{n}]")))
        else:
            out.append(text)
    return "".join(out)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates expect them: text content, arguments as objects."""
    out = []
    for n, message in enumerate(messages):
        converted = {**message, "content": content_text(message.get("content"), f"messages[{n}].content")}
        if message.get("tool_calls"):
            converted["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                       for c in tool_calls(message, f"messages[{n}]")]
        out.append(converted)
    return out


def refuse_before_tokenizing(codec: TextCodec, texts: list[str], param: str) -> None:
    """Raise a RequestError naming ``param`` when ``texts`` are surely more than ``MAX_PROMPT_TOKENS``
    tokens — at least characters / ``codec.max_token_chars`` — without tokenizing them: megabytes
    of text cost the tokenizer seconds of rank 0's CPU, for a prompt no replica would take."""
    chars = sum(len(t) for t in texts)
    at_least = chars // codec.max_token_chars
    if at_least > MAX_PROMPT_TOKENS:
        raise RequestError(f"{param}: {chars} characters are at least {at_least} tokens, more than the "
                           f"{MAX_PROMPT_TOKENS} a prompt may have", param)


def refuse_too_many(ids: list[int], param: str) -> list[int]:
    """``ids``, unless they are more than a replica takes (a RequestError naming ``param``)."""
    if len(ids) > MAX_PROMPT_TOKENS:
        raise RequestError(f"{param}: {len(ids)} tokens, more than the {MAX_PROMPT_TOKENS} a prompt may have", param)
    return ids


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [content_text(m.get("content"), f"messages[{n}].content") for n, m in enumerate(messages)]


def render(codec: TextCodec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt tokens for ``messages``, ending where the assistant's next turn begins; a RequestError
    naming ``messages`` when they are more than a replica takes (``MAX_PROMPT_TOKENS``), before
    tokenizing when their length alone says so."""
    refuse_before_tokenizing(codec, message_texts(messages), "messages")
    return refuse_too_many(_render(codec, messages, tools), "messages")


def encode(codec: TextCodec, text: str) -> list[int]:
    """The prompt tokens of a completion's ``prompt`` text; a RequestError naming ``prompt`` when it is
    more than a replica takes, as ``render``."""
    refuse_before_tokenizing(codec, [text], "prompt")
    return refuse_too_many(codec.encode_prompt(text), "prompt")


def _render(codec: TextCodec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    if codec.has_chat_template:
        try:
            return codec.render_chat(template_messages(messages), tools)
        except Exception as err:  # the template is the model's code: whatever it raises is about the request
            raise RequestError(f"messages: the model's chat template cannot render them ({shown(str(err))})",
                               "messages") from err
    return codec.encode_prompt(plain_text(messages))


@dataclass(frozen=True)
class Reply:
    """One completion as an assistant message."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"


def reply_of(text: str, finish_reason: str) -> Reply:
    """The assistant message for a completion's ``text`` (its first tool call, if it made one)."""
    span = first_call_span(text)
    if span is not None:
        (call,) = parse_tool_calls(text[span[0]:span[1]])
        if call.error is None:
            return Reply(text[:span[0]], [call], FINISH_TOOL_CALLS)
    return Reply(text, [], FINISH_LENGTH if finish_reason == FINISH_LENGTH else "stop")


def openai_message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for c in reply.calls]
    return message


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(reply: Reply, model: str, created: int, tokens: tuple[int, int]) -> dict[str, Any]:
    """A ``chat.completion`` body; ``tokens`` = (prompt, completion) token counts."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": openai_message(reply), "finish_reason": reply.finish_reason,
                         "logprobs": None}],
            "usage": usage(*tokens)}


def chat_chunks(reply: Reply, model: str, created: int, tokens: tuple[int, int]) -> list[dict[str, Any]]:
    """The same completion as ``chat.completion.chunk`` events: the message, then the finish (with usage)."""
    message = openai_message(reply)
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": n, **call} for n, call in enumerate(message["tool_calls"])]
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": created,
            "model": model}
    return [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}],
             "usage": usage(*tokens)}]


def text_completion(text: str, finish_reason: str, model: str, created: int, tokens: tuple[int, int]) -> dict[str, Any]:
    """A ``text_completion`` body (``/v1/completions``)."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(*tokens)}
