"""A misbehaving agent against the gateway (issue 69): hostile chat bodies get a 4xx, never a 500; a
refused first call leaves no session holding a staleness slot; a client refused too often is limited
before its body is read; a client whose sessions are abandoned cannot hold the budget against another."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

from kuberl.models.tiny import char_tokenizer

from .test_gateway import AGENT_TOKEN, gateway_over


class SlowReward:
    """A reward that takes a second to score (the Scorer protocol; what a code reward does)."""

    timeouts = errors = 0
    concurrent = True

    async def score(self, prompt: str, completion: str, answer: str, row: dict[str, Any]) -> float:
        await asyncio.sleep(1.0)
        return 1.0

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def test_hostile_chat_bodies_get_a_4xx_never_a_500():
    """Issue 69, item 8, tried as a new user would with the AsyncOpenAI client: tool-call arguments
    nested 100,000 deep, a tool message answering no call, a tool_call_id that is not a string — each a
    400 naming the field; a reward for a session that ended while its first reward was scored — 409."""
    from kuberl.models.tiny import tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    with gateway_over(model, tok, batch_size=4, max_staleness=4, reward=SlowReward()) as (gateway, sync_client):
        client = openai.AsyncOpenAI(base_url=str(sync_client.base_url), api_key=AGENT_TOKEN, max_retries=0)
        user = {"role": "user", "content": "12*34="}
        deep = "[" * 100_000 + "]" * 100_000
        call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": deep}}
        cases = [([user, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "1"}], "function.arguments"),
                 ([user, {"role": "tool", "tool_call_id": "call_404", "content": "1"}], "tool_call_id"),
                 ([user, {"role": "tool", "tool_call_id": ["x"], "content": "1"}], "tool_call_id")]

        async def tried() -> list[str]:
            messages = []
            for n, (body, field) in enumerate(cases):
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model="tiny-agent", max_tokens=4, messages=body,
                                                         extra_headers={"X-KubeRL-Session": f"h{n}"})
                assert field in str(refused.value), refused.value
                messages.append(str(refused.value))
            task = await client.get("/tasks/next", cast_to=object)
            headers = {"X-KubeRL-Session": "scored", "X-KubeRL-Group": task["group"]}
            await client.chat.completions.create(model="tiny-agent", max_tokens=4, messages=[user],
                                                 extra_headers=headers)
            slow = asyncio.create_task(client.post("/sessions/scored/reward", body={"completion": "408"},
                                                   cast_to=object))
            await asyncio.sleep(0.3)
            await client.post("/sessions/scored/reward", body={"reward": 0.5}, cast_to=object)
            with pytest.raises(openai.ConflictError):
                await slow
            return messages

        asyncio.run(tried())
        assert gateway.table.get("scored") is not None and gateway.table.get("scored").reward == 0.5


@pytest.mark.slow
def test_refused_calls_leave_no_session_and_a_flooding_client_is_limited_before_its_body_is_read():
    """Issue 69, item 9: an agent retrying a refused call in a tight loop, each call a new session, held
    training for 9½ minutes: each refused first call left a session holding its group's staleness slot
    until the session timeout. Now a refused first call leaves nothing (its slot reopens at once), and a
    client refused ``burst`` times in a row gets 429 + Retry-After while other clients are served."""
    from kuberl.models.tiny import tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    with gateway_over(model, tok, batch_size=2, max_staleness=0) as (gateway, client):
        client = client.with_options(max_retries=0)
        gateway.refusals.burst, gateway.refusals.rate = 5.0, 0.01
        user = [{"role": "user", "content": "12*34="}]
        statuses = []
        started = time.monotonic()
        for n in range(8):  # n=2 is refused after the session joined its group
            try:
                client.chat.completions.create(model="tiny-agent", max_tokens=4, messages=user, n=2,
                                               extra_headers={"X-KubeRL-Session": f"flood-{n}",
                                                              "X-KubeRL-Group": f"g{n}"})
            except openai.APIStatusError as err:
                statuses.append(err.status_code)
                if err.status_code == 429:
                    assert int(err.response.headers["Retry-After"]) >= 1
        assert statuses == [400] * 5 + [429] * 3, statuses
        assert time.monotonic() - started >= 3.0  # each 429 held a second: a tight loop is slowed to 1 call/s
        assert gateway.table.sessions == {} and gateway.table.filling == {}  # no slot held by the refused
        assert gateway.summary()["limited"] == 3
        assert gateway.controller.manager.running == 0  # every refused group's slot reopened
        gateway.refusals.rate = 100.0
        time.sleep(gateway.refusals.retry_after("127.0.0.1") or 0.0)  # the bucket refills
        for n in range(2):  # the budget's two groups are free: both admitted at once, no 429
            ok = client.chat.completions.create(model="tiny-agent", max_tokens=4, messages=user,
                                                extra_headers={"X-KubeRL-Session": f"real-{n}",
                                                               "X-KubeRL-Group": f"r{n}"})
            assert ok.choices[0].message.role == "assistant"


def test_a_refusal_budget_refills_at_its_rate():
    from kuberl.gateway.refusals import RefusalBudget

    now = [0.0]
    budget = RefusalBudget(rate=2.0, burst=3.0, clock=lambda: now[0])
    for _ in range(3):
        assert budget.retry_after("a") is None
        budget.charge("a")
    assert budget.retry_after("a") == pytest.approx(0.5) and budget.retry_after("b") is None
    now[0] = 0.5
    assert budget.retry_after("a") is None


def test_a_client_that_abandons_its_sessions_cannot_hold_the_budget_against_another():
    """Issue 69, item 9: sessions opened with one valid call and never rewarded held every staleness slot
    until they timed out (600 s by default), and another client's episodes got 429s meanwhile. Now a
    client waiting for a slot takes back the idle groups of a client holding more than its share."""
    import httpx

    from kuberl.models.tiny import tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    with gateway_over(model, tok, batch_size=2, max_staleness=0, admission_wait=5.0) as (gateway, client):
        gateway.config.reclaim_idle = 0.5
        body = {"model": "tiny-agent", "max_tokens": 4, "messages": [{"role": "user", "content": "12*34="}]}
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30,
                             headers={"Authorization": f"Bearer {AGENT_TOKEN}"})
        with other:
            for n in range(2):  # the whole window (2 groups), then never a reward
                answered = other.post(f"{client.base_url}chat/completions", json=body,
                                      headers={"X-KubeRL-Session": f"gone-{n}", "X-KubeRL-Group": f"a{n}"})
                assert answered.status_code == 200, answered.text
        mine = client.with_options(max_retries=0).chat.completions.create(  # a 429 after 5 s would raise
            **body, extra_headers={"X-KubeRL-Session": "mine", "X-KubeRL-Group": "b"})
        assert mine.choices[0].message.role == "assistant"
        assert gateway.summary()["reclaimed"] == 1  # one group: a fair share of two clients is one each
        assert gateway.table.get("gone-0") is None or gateway.table.get("gone-1") is None


def test_reclaim_takes_only_idle_groups_beyond_a_fair_share_and_never_from_a_lone_client():
    from kuberl.gateway.sessions import SessionTable

    table = SessionTable(group_size=2, timeout=600)
    slots = iter(range(100))
    for n in range(4):
        assert table.join(f"a{n}", f"ga{n}", now=0.0, admit=lambda: next(slots), client="a") is not None
    assert table.reclaim("a", now=100.0, idle=10.0) is None  # a lone client: never
    assert table.reclaim("b", now=5.0, idle=10.0) is None  # not idle long enough
    table.get("a0").busy = True  # a call in flight: not idle
    taken = table.reclaim("b", now=100.0, idle=10.0)  # fair share: 4 open ÷ 2 clients = 2; one at a time
    assert taken is not None and taken.key == "ga1" and table.get("a1") is None and table.get("a0") is not None
    assert table.join("b0", "gb0", now=100.0, admit=lambda: next(slots), client="b") is not None
    assert table.reclaim("b", now=100.0, idle=10.0).key == "ga2"  # a: 3 of 4, b: 1
    assert table.join("b1", "gb1", now=100.0, admit=lambda: next(slots), client="b") is not None
    assert table.reclaim("b", now=100.0, idle=10.0) is None  # 2 and 2: the fair share
    assert table.reclaimed == 2
