"""The gateway's parts that need no server: an assistant turn read back as the text the model wrote,
sessions filling groups and expiring, a rewritten history starting a new segment (and holding one),
hostile ``messages`` refused naming the field, and a real chat template turning a tool episode into one
masked trajectory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kuberl.agent.tools import call_text, parse_tool_calls
from kuberl.gateway import chat
from kuberl.gateway.sessions import SessionTable
from kuberl.models.text import TextCodec
from kuberl.models.tiny import char_tokenizer


def test_an_assistant_turn_reads_back_as_the_text_the_model_wrote():
    for text in ["calc(37*12)", 'ok <tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>']:
        reply = chat.reply_of(text, "stop")
        assert reply.finish_reason == "tool_calls"
        message = chat.openai_message(reply)
        assert chat.plain_text([message]) == text
    assert chat.reply_of("444", "stop") == chat.Reply("444", [], "stop")
    assert chat.reply_of("calc(1*", "length").finish_reason == "length"
    assert parse_tool_calls(call_text(parse_tool_calls("calc((2+3)*4)")[0]))[0].arguments == {"expression": "(2+3)*4"}
    with pytest.raises(chat.RequestError, match=r"messages\[0\]\.role"):
        chat.checked_messages([{"role": "wizard", "content": "hi"}])


def test_sessions_fill_groups_and_idle_ones_expire():
    admitted: list[int] = []

    def admit() -> int | None:
        if len(admitted) >= 2:
            return None
        admitted.append(len(admitted))
        return admitted[-1]

    table = SessionTable(group_size=2, timeout=10)
    a = table.join("a", "task-1", 0, admit)
    b = table.join("b", "task-1", 1, admit)
    c = table.join("c", None, 2, admit)
    e = table.join("e", None, 2.5, admit)
    assert a is not None and b is not None and c is not None and admitted == [0, 1]
    assert table.join("d", "task-2", 3, admit) is None  # a third group: no budget
    for s in (a, b):
        s.context([5, 6])
        s.policy([7, 8], [-0.5, -0.1], [0, 0], "stop")
    assert table.end("a", 1.0) is None  # b is still running
    group = table.end("b", 0.0)
    assert group is not None and [t.reward for t in group.result().trajectories] == [1.0, 0.0]
    for s in (c, e):
        s.context([5])
        s.policy([9], [-1.0], [0], "stop")
    assert table.end("e", 1.0) is None
    assert table.expire(now=5) == []
    (short,) = table.expire(now=13)  # c idle > 10 s: its group has 1 rewarded episode of 2
    assert short.result() is None and table.expired == 1 and table.get("c") is None


def test_a_rewritten_history_starts_a_new_segment():
    table = SessionTable(group_size=1, timeout=10)
    s = table.join("s", None, 0, lambda: 0)
    assert s is not None
    assert s.context([1, 2]) == [1, 2]
    s.policy([3, 4], [-1.0, -1.0], [0, 0], "stop")
    assert s.context([1, 2, 3, 4, 9]) == [1, 2, 3, 4, 9]  # extends it: 9 is context
    assert s.segment is not None and s.segment.episode.mask == [1, 1, 0]
    s.policy([5], [-1.0], [1], "stop")
    assert s.context([1, 7]) == [1, 7] and s.prefix_breaks == 1
    s.policy([8], [-1.0], [1], "stop")
    assert s.stored_tokens == 3 and s.generated_tokens == 4  # the old segment is gone, its tokens counted
    s.reward = 1.0
    trajectory = s.trajectory(0)
    assert trajectory is not None and trajectory.output_ids == [8] and trajectory.prompt_ids == [1, 7]


def test_a_thousand_rewritten_histories_keep_one_segment_of_memory():
    """An agent that rewrites its history on every call (issue 24, item 4): each rewrite used to open
    a segment holding the whole prompt, kept until the session ended. Now a session holds one."""
    import tracemalloc

    table = SessionTable(group_size=1, timeout=10)
    s = table.join("s", None, 0, lambda: 0)
    assert s is not None
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for call in range(1000):
            prompt = [call % 97 + 1, *range(2, 500)]  # 499 tokens, a different first one each time
            s.context(prompt)
            s.policy([7, 8], [-1.0, -1.0], [0, 0], "stop")
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert s.prefix_breaks == 999 and s.generated_tokens == 2000
    assert table.stored_tokens == 501  # one segment: its prompt and the last completion
    assert held < 256 * 1024, f"{held} bytes held after 1,000 rewrites"  # 1,000 segments: ≈ 4 MB


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                      max_size=4), max_leaves=20)
message_like = st.fixed_dictionaries({"role": st.sampled_from([*chat.ROLES, "wizard"])},
                                     optional={"content": json_values, "tool_calls": json_values})


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.lists(message_like, max_size=5)))
def test_hostile_messages_get_a_request_error_naming_the_field(messages):
    """Whatever a client sends as ``messages`` renders or is refused with a RequestError (a 400 that
    names the field), never another exception (a 500)."""
    tok = char_tokenizer()
    try:
        ids = chat.render(TextCodec(tok), chat.checked_messages(messages), None)
    except chat.RequestError as err:
        assert err.param is not None and str(err).startswith(err.param.split("[")[0])
    else:
        assert isinstance(ids, list)


TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_real_chat_template_turns_a_tool_episode_into_one_masked_trajectory():
    """A BPE tokenizer with a chat template that writes tool calls the way the model does: the
    second call's rendered prompt extends the first call's tokens (no new segment), and only what
    the policy wrote is trained on."""
    from tests.hf_model import bpe_tokenizer

    tok = bpe_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    table = SessionTable(group_size=1, timeout=60)
    session = table.join("s", None, 0, lambda: 0)
    assert session is not None
    user = {"role": "user", "content": "what is the sum of these numbers 12+7"}
    written = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+7"}}</tool_call>'
    ids = tok(written, add_special_tokens=False).input_ids
    session.context(chat.render(TextCodec(tok), [user], None))
    session.policy(ids, [-0.5] * len(ids), [3] * len(ids), "stop")
    reply = chat.reply_of(tok.decode(ids), "stop")
    assert reply.finish_reason == "tool_calls" and reply.calls[0].arguments == {"expression": "12+7"}
    messages = [user, chat.openai_message(reply), {"role": "tool", "content": "19", "tool_call_id": "c"}]
    session.context(chat.render(TextCodec(tok), messages, None))
    final = [*tok("19", add_special_tokens=False).input_ids, tok.eos_token_id]
    session.policy(final, [-0.1] * len(final), [4] * len(final), "stop")
    session.reward = 1.0
    trajectory = session.trajectory(0)
    assert session.prefix_breaks == 0 and trajectory is not None
    context = [i for i, m in zip(trajectory.output_ids, trajectory.trained, strict=True) if m == 0]
    assert tok.decode(context) == "<|im_end|>\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n"
    assert trajectory.trained_tokens == len(ids) + len(final) and trajectory.oldest_version == 3
