"""The OpenAI-compatible gateway, driven by the real ``openai`` client: an agent's calls become
rewarded, masked, grouped trajectories; an exhausted staleness budget holds a new session's first
call until the trainer catches up, and after the hold answers 429 + Retry-After, and the client's own
retry gets through once the trainer has caught up."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kuberl.api.spec import DatasetSource
from kuberl.data.datasets import examples
from kuberl.local.processes import free_port
from kuberl.models.tiny import char_tokenizer
from kuberl.weights.sync import BroadcastSync, to_safetensors

from .conftest import load_tool_warmed
from .loopback import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "gateway-test-token-0123456789"  # the pool's
AGENT_TOKEN = "agent-test-token-9876543210"  # the gateway's: all an agent holds


def load_agent() -> Any:
    spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / "examples/agents/calculator_agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def gateway_over(model: Any, tok: Any, batch_size: int = 1, max_staleness: int = 0,
                 admission_wait: float = 1.0, reward: Any = None) -> Iterator[Any]:
    """``model`` behind the real inference server, a rollout controller whose episodes come from
    outside (``batch_size`` groups of 2 a step, η = ``max_staleness``), and the gateway in front
    (a new session waits ``admission_wait`` s for the budget before its 429): yields (gateway, an
    openai client holding the agent's token)."""
    from kuberl.gateway.server import Gateway, GatewayConfig
    from kuberl.inference.engine import TorchEngine
    from kuberl.inference.server import build_app
    from kuberl.rollout.client import InferenceClient
    from kuberl.rollout.controller import RolloutController
    from kuberl.rollout.staleness import StalenessManager

    engine = TorchEngine(copy.deepcopy(model).eval(), tok.eos_token_id, tok.pad_token_id, seed=0)
    inference_port, gateway_port = free_port(), free_port()
    stop_inference = serve_in_thread(build_app(engine, tok, TOKEN), inference_port)
    controller = RolloutController(InferenceClient([f"http://127.0.0.1:{inference_port}"], TOKEN), None, None,
                                   StalenessManager(batch_size=batch_size, max_staleness=max_staleness,
                                                    max_concurrent=4))
    controller.start()
    gateway = Gateway(controller, tok, GatewayConfig("tiny-agent", group_size=2, max_new_tokens=24, temperature=1.0,
                                                     top_p=1.0, session_timeout=60, admission_wait=admission_wait,
                                                     reward=reward),
                      AGENT_TOKEN, tasks=examples(DatasetSource(path="builtin:multiplication-tools"), 1))
    gateway.start_in(gateway_port)
    try:
        yield gateway, openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key=AGENT_TOKEN,
                                     max_retries=10)
    finally:
        gateway.stop()
        controller.stop()
        stop_inference()


@pytest.fixture(scope="module")
def served(tool_warmed_weights) -> Any:
    """The tool-call-warmed tiny model behind the gateway (``gateway_over``: batch = 1 group of 2, η = 0)."""
    model, tok = load_tool_warmed(tool_warmed_weights)
    with gateway_over(model, tok) as (gateway, client):
        yield gateway, tok, model, client


def test_a_history_longer_than_the_models_context_gets_400_naming_messages():
    """The replica refuses a prompt with no room left in the model's context (400); the agent gets that
    400 naming its messages, not a 500, and the gateway keeps serving."""
    from kuberl.models.tiny import tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    with gateway_over(model, tok, batch_size=4, max_staleness=4) as (gateway, client):
        ask = {"model": "tiny-agent", "max_tokens": 4}
        headers = {"X-KubeRL-Session": "long", "X-KubeRL-Group": "g"}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**ask, messages=[{"role": "user", "content": "12*34=" * 60}],
                                           extra_headers=headers)
        assert "messages" in str(refused.value) and "context" in str(refused.value)
        refused_session = gateway.table.get("long")  # a refused turn leaves nothing behind
        assert refused_session is None or refused_session.stored_tokens == 0
        short = client.chat.completions.create(**ask, messages=[{"role": "user", "content": "12*34="}],
                                               extra_headers={**headers, "X-KubeRL-Session": "short"})
        assert short.choices[0].message.role == "assistant"


def test_megabytes_of_chat_are_refused_naming_messages_and_health_answers_meanwhile():
    """2 MB and 8 MB of chat are refused (400 naming messages) from their length alone, never
    tokenized; 640 kB — under that bound (at most 5 characters a token here) — is tokenized in a worker
    thread: held inside the tokenizer, /health still answers; released, it is refused for its token
    count. Nothing reaches a replica and a short call is served after. (Measured on this tokenizer,
    before the bound and the thread: 2 MB took 6 s to tokenize, and the gateway's loop waited on it.)"""
    import urllib.request

    from kuberl.inference.contract import MAX_PROMPT_TOKENS
    from kuberl.models.tiny import tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    entered, release = threading.Event(), threading.Event()

    class HeldTokenizer(type(tok)):  # type: ignore[misc]
        """The tokenizer, except that a text over 100k characters waits for ``release`` first."""

        def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(text, str) and len(text) > 100_000:
                entered.set()
                assert release.wait(120), "the test never released the tokenizer"
            return super().__call__(text, *args, **kwargs)

    tok.__class__ = HeldTokenizer
    with gateway_over(model, tok) as (gateway, client):
        health = str(client.base_url).rstrip("/").removesuffix("/v1") + "/health"
        ask = {"model": "tiny-agent", "max_tokens": 4,
               "extra_headers": {"X-KubeRL-Group": "g", "X-KubeRL-Session": "long-history"}}

        def chat(chars: int) -> str:
            """The 400's message for ``chars`` characters of chat."""
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(messages=[{"role": "user", "content": "1" * chars}], **ask)
            return str(refused.value)

        for chars in (2_000_000, 8_000_000):
            message = chat(chars)
            assert f"messages: {chars} characters are at least" in message and str(MAX_PROMPT_TOKENS) in message
        assert not entered.is_set()  # refused from their length, never tokenized
        answer: list[str] = []
        caller = threading.Thread(target=lambda: answer.append(chat(640_000)))
        caller.start()
        try:
            assert entered.wait(60), "640 kB never reached the tokenizer"
            with urllib.request.urlopen(health, timeout=30) as reply:  # the loop is free while it tokenizes
                assert json.loads(reply.read())["status"] == "ok"
            assert caller.is_alive() and not answer
        finally:
            release.set()
            caller.join(120)
        assert f"messages: {640_000 + 1} tokens, more than the {MAX_PROMPT_TOKENS}" in answer[0]  # BOS + text
        assert gateway.stats.sessions == 0  # refused before a session (or a replica) saw them
        short = client.chat.completions.create(messages=[{"role": "user", "content": "12*34="}], **ask)
        assert short.choices[0].message.role == "assistant"


def scrape_gateway_counters(gateway: Any) -> dict[str, float]:
    """The trainer's /metrics with the gateway's counts added, as rank 0 serves it."""
    import urllib.request

    from kuberl.api import Progress
    from kuberl.trainer.progress import ProgressServer

    server, port = ProgressServer(Progress()), free_port()
    server.add_counters("gateway", gateway.summary)
    server.start_in(gateway.controller.loop, port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines
                                                    if line.startswith("kuberl_gateway_"))}


def run_episodes(agent: Any, client: openai.OpenAI, n: int) -> list[float]:
    """``n`` agent episodes in parallel threads, each on the next task the gateway hands out."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return [r for rs in pool.map(lambda _: agent.work(client, "tiny-agent", 1), range(n)) for r in rs]


@pytest.mark.slow
def test_agent_episodes_become_a_rewarded_group_the_trainer_trains_on(served, world_of_one):
    from kuberl.fsdp.actor import FSDPActor
    from kuberl.policy.algorithms import AlgorithmConfig, build_batch
    from kuberl.policy.batch import collate

    gateway, tok, model, client = served
    rewards = run_episodes(load_agent(), client, 2)  # the two sessions of the first task: one group
    (group,) = gateway.controller.take(1, 0)
    trajectories = group.trajectories
    assert sorted(t.reward for t in trajectories) == sorted(rewards)
    calls = 0
    for t in trajectories:
        assert tok.decode(t.prompt_ids, skip_special_tokens=True).endswith("=")  # "37*12=": the task
        masked = [i for i, m in zip(t.output_ids, t.trained, strict=True) if m == 0]
        if masked:  # the model called the calculator: the agent's answer is context, never trained on
            calls += 1
            assert tok.decode(t.output_ids, skip_special_tokens=True).startswith("calc(")
            expression = tok.decode(t.output_ids, skip_special_tokens=True)[5:].split(")")[0]
            a, b = expression.split("*")
            assert tok.decode(masked) == f"={int(a) * int(b)}="
            assert all(lp == 0.0 for lp, m in zip(t.behav_logprobs, t.trained, strict=True) if m == 0)
        assert set(t.versions) == {0}
    assert calls >= 1, "the warmed-up model calls its calculator"
    config = AlgorithmConfig(name="grpo", group_size=2)
    actor = FSDPActor.create(copy.deepcopy(model), config, lr=1e-3, temperature=1.0)
    trajs, advantages, _ = build_batch([group], config)
    actor.train_step(collate(trajs, advantages, pad_id=tok.pad_token_id, version=0), len(trajs))
    sync = BroadcastSync(gateway.controller)
    sync.push(actor, 1)  # the new weights, to the pool, as the trainer sends them
    sync.wait()
    run_episodes(load_agent(), client, 2)
    (group,) = gateway.controller.take(1, 1)
    assert {v for t in group.trajectories for v in t.versions} == {1}  # served by the trained policy


@pytest.mark.slow  # the tool-warmed model is trained once per run (most of a minute on one core)
def test_a_call_without_budget_is_held_and_served_once_the_trainer_catches_up_without_a_429(
        tool_warmed_weights):
    """While the staleness budget is used up, a new session's first call waits for a slot instead
    of a 429 (a client retrying every 100 ms costs the trainer's process CPU): it is answered as
    soon as the trainer takes the batch and serves the next version, and nothing was refused."""
    model, tok = load_tool_warmed(tool_warmed_weights)
    ask = {"model": "tiny-agent", "messages": [{"role": "user", "content": "12*34="}]}
    with gateway_over(model, tok, admission_wait=60) as (gateway, client):
        def call(session: str, group: str) -> Any:
            headers = {"X-KubeRL-Session": session, "X-KubeRL-Group": group}
            return client.with_options(max_retries=0).chat.completions.create(**ask, extra_headers=headers)

        weights = to_safetensors(model.state_dict())
        gateway.controller.update_weights(weights, 0).result(60)
        call("s1", "g1")  # g1 takes the whole budget (η = 0, one group of 2 a step)
        call("s2", "g1")
        answered: list[Any] = []
        held = threading.Thread(target=lambda: answered.append(call("s3", "g2")))
        held.start()
        deadline = time.monotonic() + 30
        while gateway.stats.held < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert gateway.stats.held == 1 and not answered  # waiting, not refused
        for session in ("s1", "s2"):
            client.post(f"/sessions/{session}/reward", body={"reward": 1.0}, cast_to=object)
        assert gateway.controller.take(1, 0) is not None  # the trainer catches up …
        gateway.controller.update_weights(weights, 1).result(60)
        held.join(30)  # … and the held call is answered
        assert answered and answered[0].choices[0].message.role == "assistant"
        assert gateway.stats.rejected == 0 and gateway.stats.sessions == 3


@pytest.mark.slow
def test_an_exhausted_budget_answers_429_and_the_client_retry_gets_through(served):
    gateway, _, model, client = served
    ask = {"model": "tiny-agent", "messages": [{"role": "user", "content": "12*34="}]}

    def call(session: str, group: str, retries: int) -> Any:
        headers = {"X-KubeRL-Session": session, "X-KubeRL-Group": group}
        return client.with_options(max_retries=retries).chat.completions.create(**ask, extra_headers=headers)

    weights, manager = to_safetensors(model.state_dict()), gateway.controller.manager
    version = manager.accepted  # η = 0, one group per step: at version = groups accepted, one more fits
    assert manager.version <= version and manager.running == 0
    gateway.controller.update_weights(weights, version).result(60)
    call("s1", "g1", 0)  # g1 takes the whole budget
    call("s2", "g1", 0)
    with pytest.raises(openai.RateLimitError) as refused:  # after the fixture's 1 s of waiting for a slot
        call("s3", "g2", 0)
    assert refused.value.response.headers["retry-after"] == "1" and gateway.stats.held >= 1
    retried: list[Any] = []
    waiting = threading.Thread(target=lambda: retried.append(call("s3", "g2", 10)))
    waiting.start()
    deadline = time.monotonic() + 30
    while gateway.stats.rejected < 2 and time.monotonic() < deadline:  # the client is backing off
        time.sleep(0.05)
    assert gateway.stats.rejected >= 2 and not retried
    for session in ("s1", "s2"):
        client.post(f"/sessions/{session}/reward", body={"reward": 1.0}, cast_to=object)
    assert gateway.controller.take(1, version) is not None  # the trainer catches up …
    gateway.controller.update_weights(weights, version + 1).result(60)
    waiting.join(30)  # … and the retry gets through
    assert retried and retried[0].choices[0].message.role == "assistant"
    stream = client.chat.completions.create(**{**ask, "messages": [{"role": "user", "content": "21*43="}]},
                                            stream=True, extra_headers={"X-KubeRL-Session": "s3"})
    chunks = list(stream)
    cut = client.chat.completions.create(**{**ask, "messages": [{"role": "user", "content": "21*43="}]},
                                         stop=["("], extra_headers={"X-KubeRL-Session": "s4", "X-KubeRL-Group": "g2"})
    assert cut.choices[0].finish_reason == "stop" and "(" not in (cut.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError, match="one completion per call"):
        client.chat.completions.create(**ask, n=2, extra_headers={"X-KubeRL-Session": "s4"})
    delta = chunks[0].choices[0].delta
    assert delta.role == "assistant" and (delta.content or delta.tool_calls)
    assert chunks[-1].choices[0].finish_reason in ("stop", "tool_calls", "length")
    with pytest.raises(openai.NotFoundError):
        client.post("/sessions/nobody/reward", body={"reward": 1.0}, cast_to=object)
    metrics = scrape_gateway_counters(gateway)
    assert metrics["kuberl_gateway_rejected"] == gateway.stats.rejected >= 2  # the 429s, for Prometheus
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong-token-0123456789").models.list()
    with pytest.raises(openai.AuthenticationError):  # the pool's token is not the gateway's
        client.with_options(api_key=TOKEN).models.list()
    pool = openai.OpenAI(base_url=gateway.controller.client.replicas[0].url, api_key=AGENT_TOKEN, max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # … nor the agent's the pool's: it cannot push weights
        pool.post("/update_weights?version=99", body={}, cast_to=object)


@pytest.mark.slow
def test_stopping_the_gateway_with_calls_in_flight_ends_them_at_once():
    """The end of a run with agents still calling (issue 23): a completion waiting on a replica that
    does not answer must not hold the gateway's stop (the trainer's last act) past a few seconds."""
    import asyncio

    from aiohttp import web

    from kuberl.gateway.server import Gateway, GatewayConfig
    from kuberl.rollout.client import InferenceClient
    from kuberl.rollout.controller import RolloutController
    from kuberl.rollout.staleness import StalenessManager

    generating = threading.Event()

    async def never_answers(request: web.Request) -> web.Response:
        generating.set()
        await asyncio.sleep(3600)
        return web.json_response({})

    async def healthy(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    replica = web.Application()
    replica.router.add_get("/health", healthy)
    replica.router.add_post("/generate", never_answers)
    inference_port, gateway_port = free_port(), free_port()
    stop_replica = serve_in_thread(replica, inference_port)
    controller = RolloutController(InferenceClient([f"http://127.0.0.1:{inference_port}"], TOKEN), None, None,
                                   StalenessManager(batch_size=1, max_staleness=0, max_concurrent=4))
    controller.start()
    gateway = Gateway(controller, char_tokenizer(), GatewayConfig("tiny", group_size=1, max_new_tokens=4,
                                                                  temperature=1.0, top_p=1.0, session_timeout=60),
                      AGENT_TOKEN)
    gateway.start_in(gateway_port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key=AGENT_TOKEN, max_retries=0,
                           timeout=120)
    outcome: list[BaseException | object] = []

    def call() -> None:
        try:
            outcome.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "3+4="}],
                                                          extra_headers={"X-KubeRL-Session": "episode-1"}))
        except BaseException as err:  # what the agent sees is checked below
            outcome.append(err)

    agent = threading.Thread(target=call, daemon=True)
    agent.start()
    try:
        assert generating.wait(30), f"the completion never reached the replica: {outcome}"
        started = time.monotonic()
        gateway.stop()
        stopped_after = time.monotonic() - started
        agent.join(30)
    finally:
        controller.stop()
        stop_replica()
    assert stopped_after < 10, f"stop took {stopped_after:.1f} s"
    assert not agent.is_alive() and outcome and isinstance(outcome[0], openai.APIError), outcome
