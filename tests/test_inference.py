"""The torch engine and the inference HTTP contract."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
import time

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from kuberl.auth import bearer
from kuberl.inference.engine import SamplingParams, TorchEngine, sample_tokens
from kuberl.inference.faults import FaultPlan, fault_plan
from kuberl.inference.server import build_app, parse_generate
from kuberl.jsonbody import MAX_JSON_BYTES
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.settings import Settings

TOKEN = "test-token-0123456789"


@pytest.fixture
def tok():
    return char_tokenizer()


def make_engine(tok, seed=0):
    return TorchEngine(tiny_qwen2(len(tok), seed=seed), tok.eos_token_id, tok.pad_token_id)


def prompt(tok, text):
    return [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]


def recompute_logprobs(model, ids: list[int], n_out: int, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -n_out - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[-n_out:]).unsqueeze(-1)).squeeze(-1)


async def test_generate_logprobs_match_the_model(tok):
    engine = make_engine(tok)
    engine.start()
    try:
        ps = [prompt(tok, "1+2="), prompt(tok, "12+34=")]  # different lengths share a batch
        params = SamplingParams(max_new_tokens=6, temperature=0.7)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in ps))
    finally:
        await engine.stop()
    for p, out in zip(ps, outs, strict=True):
        assert out.finish_reason in ("stop", "length") and 1 <= len(out.output_ids) <= 6
        assert out.versions == [0] * len(out.output_ids)
        expected = recompute_logprobs(engine.model, p + out.output_ids, len(out.output_ids), 0.7)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_sampled_tokens_follow_the_temperature_scaled_top_p_distribution():
    """200,000 draws from 4 rows (temperatures 0.5 / 1 / 2, one with top-p 0.6, one greedy): each
    token's frequency is within 4.5 standard errors of its probability, a token outside the top-p
    nucleus is never drawn, and greedy rows always take the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 2
    temperature = torch.tensor([0.5, 1.0, 2.0, 0.0])
    top_p = torch.tensor([1.0, 0.6, 1.0, 1.0])
    draws = 50_000
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(4, 50)
    for _ in range(draws // 5_000):
        tokens, logps = sample_tokens(logits.repeat(5_000, 1), temperature.repeat(5_000), top_p.repeat(5_000),
                                      generator)
        counts.scatter_add_(1, tokens.view(5_000, 4).T, torch.ones(4, 5_000))
        scaled = torch.log_softmax(logits[:3] / temperature[:3, None], -1)
        assert torch.allclose(logps.view(5_000, 4)[:, :3], scaled.gather(1, tokens.view(5_000, 4)[:, :3].T).T)
    expected = torch.softmax(logits[:3] / temperature[:3, None], -1)
    ranked, order = expected[1].sort(descending=True)
    outside = order[(ranked.cumsum(0) - ranked) > 0.6]
    nucleus = expected[1].clone()
    nucleus[outside] = 0
    expected[1] = nucleus / nucleus.sum()
    frequency = counts[:3] / draws
    standard_error = (expected * (1 - expected) / draws).sqrt()
    assert ((frequency - expected).abs() <= 4.5 * standard_error + 1e-6).all()
    assert counts[1, outside].sum() == 0 and len(outside) > 10
    assert counts[3, logits[3].argmax()] == draws


async def wait_for_tokens(engine: TorchEngine, count: int) -> None:
    while engine.generated_tokens < count:
        await asyncio.sleep(0.001)


async def test_requests_joining_leaving_and_new_weights_mid_flight_sample_what_an_uncached_forward_would(tok):
    """The KV cache is invisible: requests join while others run (different lengths), leave at
    different lengths, and new weights arrive mid-generation; every token's log-prob equals the
    one recomputed without a cache, from the whole sequence, under the weights of its version."""
    engine = make_engine(tok)
    old_model, new_model = tiny_qwen2(len(tok), seed=0), tiny_qwen2(len(tok), seed=1)
    engine.start()
    try:
        first = [asyncio.ensure_future(engine.generate(prompt(tok, text), SamplingParams(max_new_tokens=n)))
                 for text, n in (("1+2=", 30), ("12*34+5=", 9))]
        await wait_for_tokens(engine, 6)
        later = [asyncio.ensure_future(engine.generate(prompt(tok, text), SamplingParams(max_new_tokens=n)))
                 for text, n in (("7=", 25), ("123+456+789+1=", 14))]
        await wait_for_tokens(engine, 30)
        await engine.load_weights(new_model.state_dict(), version=1)
        outs = await asyncio.gather(*first, *later)
    finally:
        await engine.stop()
    texts = ("1+2=", "12*34+5=", "7=", "123+456+789+1=")
    assert {0, 1} <= {v for out in outs for v in out.versions}  # the update landed mid-flight
    for text, out in zip(texts, outs, strict=True):
        ids, n = prompt(tok, text) + out.output_ids, len(out.output_ids)
        under = {0: recompute_logprobs(old_model, ids, n, 1.0), 1: recompute_logprobs(new_model, ids, n, 1.0)}
        expected = torch.stack([under[v][i] for i, v in enumerate(out.versions)])
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5), text


async def test_greedy_is_deterministic(tok):
    engine = make_engine(tok)
    engine.start()
    try:
        a = await engine.generate(prompt(tok, "3+4="), SamplingParams(max_new_tokens=5, temperature=0))
        b = await engine.generate(prompt(tok, "3+4="), SamplingParams(max_new_tokens=5, temperature=0))
    finally:
        await engine.stop()
    assert a.output_ids == b.output_ids


async def test_pause_aborts_with_partial_tokens_and_resume_completes(tok):
    engine = make_engine(tok)
    engine.eos_id = -1  # never stop early: the request runs until max_new_tokens
    engine.start()
    try:
        p = prompt(tok, "5+5=")
        task = asyncio.create_task(engine.generate(p, SamplingParams(max_new_tokens=40)))
        while engine.generated_tokens < 3:
            await asyncio.sleep(0.001)
        assert await engine.pause() == 1
        partial = await task
        assert partial.finish_reason == "abort" and 3 <= len(partial.output_ids) < 40
        # While paused, new work waits; the new weights arrive, then the client resumes.
        new_model = tiny_qwen2(len(tok), seed=7)
        await engine.load_weights(new_model.state_dict(), version=1)
        waiting = asyncio.create_task(engine.generate(p + partial.output_ids,
                                                      SamplingParams(max_new_tokens=40 - len(partial.output_ids))))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        engine.resume()
        rest = await waiting
    finally:
        await engine.stop()
    assert len(partial.output_ids) + len(rest.output_ids) == 40
    assert set(partial.versions) == {0} and set(rest.versions) == {1}


async def test_http_contract_and_weight_update(tok):
    engine = make_engine(tok)
    trainer_model = tiny_qwen2(len(tok), seed=123)
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        r = await client.post("/generate", json={"prompt": "2+2=", "max_new_tokens": 4, "n": 3})
        body = await r.json()
        assert r.status == 200 and body["version"] == 0 and len(body["outputs"]) == 3
        buf = io.BytesIO(save_safetensors({k: v.contiguous().clone() for k, v in trainer_model.state_dict().items()}))
        r = await client.post("/update_weights?version=5", data=buf.getvalue())
        assert r.status == 200 and (await r.json())["version"] == 5
        for name, tensor in trainer_model.state_dict().items():
            assert torch.equal(engine.model.state_dict()[name], tensor), name
        r = await client.post("/generate", json={"input_ids": prompt(tok, "1+1="), "max_new_tokens": 3})
        assert set((await r.json())["outputs"][0]["versions"]) == {5}
        assert (await client.get("/health")).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert "kuberl_inference_weight_version 5.0" in metrics
        bad = await client.post("/generate", json={"input_ids": []})
        assert bad.status == 400 and "input_ids" in await bad.text()
        assert (await client.post("/update_weights", data=b"")).status == 400


PROTECTED = [("POST", "/generate"), ("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weights?version=9"),
             ("POST", "/weights/p2p/join"), ("POST", "/weights/p2p/receive?version=9")]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"},
                                     {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}])
async def test_state_changing_endpoints_need_the_api_token(tok, headers):
    engine = make_engine(tok)
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=headers) as client:
        for method, path in PROTECTED:
            r = await client.request(method, path, json={"input_ids": [1, 2]})
            assert r.status == 401, (path, r.status)
            assert r.headers["WWW-Authenticate"] == "Bearer" and TOKEN not in await r.text()
        assert not engine.paused and engine.version == 0  # nothing happened
        for path in ("/health", "/version", "/topology", "/metrics"):  # read-only: open (probes, scraper)
            assert (await client.get(path)).status == 200, path


async def test_an_authorization_header_that_is_not_utf8_gets_401_not_500(tok):
    engine = make_engine(tok)
    server = TestServer(build_app(engine, tok, TOKEN))
    await server.start_server()
    try:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST /pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe" + TOKEN.encode()
                     + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
        writer.close()
        assert status_line.split()[1] == b"401", status_line
        assert not engine.paused
    finally:
        await server.close()


async def test_a_file_update_reads_only_from_the_shared_weights_directory(tok, tmp_path):
    """``/update_weights?path=`` (disk mode) reads the file the trainer wrote to the shared directory
    and nothing else of the pod: not a file elsewhere, not one linked from inside; none at all in
    another mode."""
    shared, update = tmp_path / "weights", tiny_qwen2(len(tok), seed=5).state_dict()
    shared.mkdir()
    state = {k: v.contiguous().clone() for k, v in update.items()}
    (tmp_path / "elsewhere.safetensors").write_bytes(save_safetensors(state))
    (shared / "weights-v00000009.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    (shared / "weights-v00000003.safetensors").write_bytes(save_safetensors(state))
    engine = make_engine(tok)
    for directory, path, status in [(shared, tmp_path / "elsewhere.safetensors", 400),
                                    (shared, shared / "weights-v00000009.safetensors", 400),
                                    (shared, shared / ".." / "elsewhere.safetensors", 400),
                                    (None, shared / "weights-v00000003.safetensors", 400),
                                    (shared, shared / "weights-v00000003.safetensors", 200)]:
        app = build_app(engine, tok, TOKEN, directory)
        async with TestClient(TestServer(app), headers=bearer(TOKEN)) as client:
            r = await client.post("/update_weights", params={"version": "3", "path": str(path)})
            assert r.status == status, (path, await r.text())
            assert engine.version == (3 if status == 200 else 0)


async def test_json_bodies_are_capped(tok):
    engine = make_engine(tok)
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        huge = b'{"input_ids": [' + b"1," * (MAX_JSON_BYTES // 2) + b'1]}'
        assert (await client.post("/generate", data=huge)).status == 413
        async def stream():
            for i in range(0, len(huge), 2**20):
                yield huge[i:i + 2**20]

        chunked = await client.post("/generate", data=stream())  # no Content-Length: counted while read
        assert chunked.status == 413
        ok = await client.post("/generate", json={"input_ids": prompt(tok, "1+1="), "max_new_tokens": 2})
        assert ok.status == 200


async def test_pause_racing_the_engine_loop_never_loses_requests(tok):
    """Regression: a pause between activation and the step used to crash the engine loop silently."""
    engine = make_engine(tok)
    engine.start()
    try:
        for _ in range(30):
            tasks = [asyncio.create_task(engine.generate(prompt(tok, "1+1="), SamplingParams(max_new_tokens=3)))
                     for _ in range(4)]
            await asyncio.sleep(0)  # let the loop activate them
            await engine.pause()
            engine.resume()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            assert all(o.finish_reason in ("stop", "length", "abort") for o in outs)
        assert engine.health() is None
    finally:
        await engine.stop()


@pytest.mark.parametrize("body", [
    {"input_ids": [-1, 3]}, {"input_ids": [10**9]}, {"input_ids": [True]}, {"input_ids": "1,2"},
    {"input_ids": [2, 3], "n": 10**6}, {"input_ids": [2, 3], "max_new_tokens": 10**9},
    {"input_ids": [2, 3], "temperature": "hot"}, {"input_ids": [2, 3], "top_p": 0}, [1, 2], "text",
])
async def test_hostile_generate_bodies_get_400_and_the_engine_lives(tok, body):
    engine = make_engine(tok)
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        r = await client.post("/generate", json=body)
        assert r.status == 400, await r.text()
        deep = await client.post("/generate", data="[" * 100_000 + "]" * 100_000)
        assert deep.status == 400
        ok = await client.post("/generate", json={"input_ids": prompt(tok, "1+1="), "max_new_tokens": 2})
        assert ok.status == 200 and engine.health() is None and (await client.get("/health")).status == 200


async def greedy_logprobs(client, ids: list[int]) -> list[float]:
    r = await client.post("/generate", json={"input_ids": ids, "max_new_tokens": 8, "temperature": 0})
    assert r.status == 200, await r.text()
    return (await r.json())["outputs"][0]["logprobs"]


@pytest.mark.parametrize("break_it", ["missing", "wrong shape"])
async def test_a_bad_weight_update_is_refused_whole_and_the_old_weights_stay_served(tok, break_it):
    engine = make_engine(tok)
    update = {k: v.contiguous().clone() for k, v in tiny_qwen2(len(tok), seed=7).state_dict().items()}
    last = sorted(update)[-1]  # every other tensor is fine: a partial load would change the outputs
    if break_it == "missing":
        del update[last]
    else:
        update[last] = torch.zeros(3, 3)
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        ids = prompt(tok, "12+34=")
        before = await greedy_logprobs(client, ids)
        r = await client.post("/update_weights?version=3", data=save_safetensors(update))
        assert r.status == 400 and break_it in await r.text() and last in await r.text()
        assert engine.version == 0 and await greedy_logprobs(client, ids) == before


async def test_a_prompt_that_fills_the_context_gets_400_and_one_that_nearly_does_stops_at_it(tok):
    engine = make_engine(tok)
    room = engine.max_model_len
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        full = await client.post("/generate", json={"input_ids": [5] * room, "max_new_tokens": 1})
        assert full.status == 400 and "input_ids" in await full.text() and str(room) in await full.text()
        near = await client.post("/generate", json={"input_ids": [5] * (room - 2), "max_new_tokens": 50})
        (out,) = (await near.json())["outputs"]
        assert near.status == 200 and len(out["output_ids"]) <= 2 and out["finish_reason"] in ("stop", "length")


def crash(*_: object) -> None:
    raise RuntimeError("device lost")


async def test_a_crashed_engine_answers_503_at_once_and_reports_it_on_health(tok):
    model = tiny_qwen2(len(tok), seed=0)
    model.register_forward_pre_hook(crash)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        body = {"input_ids": prompt(tok, "1+1="), "max_new_tokens": 2}
        first = await asyncio.wait_for(client.post("/generate", json=body), timeout=10)
        assert first.status == 503 and "device lost" in await first.text()
        later = await asyncio.wait_for(client.post("/generate", json=body), timeout=5)  # not queued for nobody
        assert later.status == 503
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "engine stopped"


async def test_a_hung_engine_fails_its_health_check_until_it_steps_again(tok):
    now = [1000.0]  # the engine reads this clock: the test decides when 60 s have passed
    entered, release = threading.Event(), threading.Event()
    model = tiny_qwen2(len(tok), seed=0)
    model.register_forward_pre_hook(lambda *_: (entered.set(), release.wait(30)) and None)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, stall_seconds=60, clock=lambda: now[0])
    async with TestClient(TestServer(build_app(engine, tok, TOKEN)), headers=bearer(TOKEN)) as client:
        call = asyncio.create_task(client.post("/generate", json={"input_ids": prompt(tok, "1+1="),
                                                                   "max_new_tokens": 1}))
        assert await asyncio.to_thread(entered.wait, 10)
        assert (await client.get("/health")).status == 200  # a step in progress, not stalled yet
        now[0] += 61
        hung = await client.get("/health")
        assert hung.status == 503 and "hung" in (await hung.json())["status"]
        release.set()
        assert (await call).status == 200
        assert (await client.get("/health")).status == 200


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["input_ids", "prompt", "n", "max_new_tokens", "temperature", "top_p", "x"]),
                        inner, max_size=5), max_leaves=20))
def test_parse_generate_answers_any_json_with_a_request_or_a_field_naming_error(body):
    try:
        ids, params, n = parse_generate(body, vocab_size=50, tokenizer=None)
    except ValueError as err:
        assert str(err)  # one line naming the field (or the shape)
        return
    assert ids and all(0 <= i < 50 for i in ids) and 1 <= n <= 64 and 1 <= params.max_new_tokens <= 32768


async def test_the_fault_door_makes_generate_answer_500_between_the_two_signals_and_is_shut_by_default(tok):
    """Chaos tests' door (KUBERL_FAULT_INJECTION=signals): SIGUSR1 → /generate 500, /health still 200;
    SIGUSR2 → served again. Without the setting the signals are not handled by the server."""
    loop = asyncio.get_running_loop()
    body = {"input_ids": prompt(tok, "1+1="), "max_new_tokens": 2}
    app = build_app(make_engine(tok), tok, TOKEN, settings=Settings(fault_injection="signals"))
    try:
        async with TestClient(TestServer(app), headers=bearer(TOKEN)) as client:
            assert (await client.post("/generate", json=body)).status == 200
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.sleep(0.05)  # the handler runs on the loop
            failed = await client.post("/generate", json=body)
            assert failed.status == 500 and "injected fault" in await failed.text()
            assert (await client.get("/health")).status == 200
            os.kill(os.getpid(), signal.SIGUSR2)
            await asyncio.sleep(0.05)
            assert (await client.post("/generate", json=body)).status == 200
    finally:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
    async with TestClient(TestServer(build_app(make_engine(tok), tok, TOKEN)), headers=bearer(TOKEN)):
        assert not loop.remove_signal_handler(signal.SIGUSR1)  # none installed
    with pytest.raises(ValueError, match=r"KUBERL_FAULT_INJECTION: 'yes'.*allowed: signals"):
        build_app(make_engine(tok), tok, TOKEN, settings=Settings(fault_injection="yes"))


async def test_a_slow_replica_of_fixed_capacity_holds_each_generate_and_serves_that_many_at_once(tok):
    """KUBERL_FAULT_INJECTION=generate-slots=2,generate-seconds=S: four requests at once take two waves
    of at least S each (an accelerator of fixed capacity, whatever the host's CPUs)."""
    body = {"input_ids": prompt(tok, "1+1="), "max_new_tokens": 2}
    seconds = 0.3
    app = build_app(make_engine(tok), tok, TOKEN,
                    settings=Settings(fault_injection=f"generate-slots=2,generate-seconds={seconds}"))
    async with TestClient(TestServer(app), headers=bearer(TOKEN)) as client:
        started = time.monotonic()
        replies = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(4)))
        elapsed = time.monotonic() - started
        assert [r.status for r in replies] == [200] * 4
        assert elapsed >= 2 * seconds


@pytest.mark.parametrize("mode", ["generate-slots=2", "generate-seconds=1", "generate-slots=0,generate-seconds=1",
                                  "generate-slots=two,generate-seconds=1", "signals=1", "slow"])
def test_a_malformed_fault_injection_is_refused_naming_the_variable(mode):
    with pytest.raises(ValueError, match=r"KUBERL_FAULT_INJECTION: .*allowed: signals, generate-slots"):
        fault_plan(mode)


def test_fault_injection_items_combine():
    assert fault_plan("signals, generate-slots=3,generate-seconds=0.5") == FaultPlan(True, 3, 0.5)
    assert fault_plan("") == FaultPlan()


def test_a_16_bit_engine_rotates_positions_as_the_trainer_does(tmp_path):
    """The replica's model in bfloat16 (``torch_engine_for``, as ``python -m kuberl.inference`` builds
    it) computes its rotary angles from float32 frequencies, as the trainer (FSDP2 casts parameters
    only) and ``from_pretrained(dtype=bfloat16)`` do: its cos/sin at every position equal the float32
    model's rounded once. Frequencies cast to bfloat16 (``Module.to``) would turn position 4000's
    angles by radians (Qwen3's θ = 10⁶)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kuberl.api.spec import RLExperimentSpec
    from kuberl.inference.__main__ import torch_engine_for
    from kuberl.runconfig import RunConfig

    tokenizer = char_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_theta=1e6,
                         max_position_embeddings=4096)  # fmt: skip
    reference = Qwen3ForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    spec = RLExperimentSpec.model_validate({
        "model": {"path": f"file://{tmp_path}", "dtype": "bfloat16"}, "dataset": {"path": "builtin:arithmetic"},
        "reward": {"function": "kuberl.rewards:exact_match"},
        "inference": {"accelerator": "cpu"}, "trainer": {"accelerator": "cpu"}})
    engine, _ = torch_engine_for(RunConfig("rope", spec), Settings())
    served = engine.model
    assert next(served.parameters()).dtype == torch.bfloat16
    positions = torch.arange(config.max_position_embeddings)[None]
    probe = torch.zeros(1, 1, dtype=torch.bfloat16)
    with torch.no_grad():
        cos, sin = served.model.rotary_emb(probe, positions)
        cos32, sin32 = reference.model.rotary_emb(probe.float(), positions)
    assert cos.dtype == torch.bfloat16
    assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16)), (
        (cos.float() - cos32).abs().max())
