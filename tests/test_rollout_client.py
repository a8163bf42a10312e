"""The rollout client against real inference servers: balancing, abort → resume, pause under load,
and containment — a replica that answers 5xx, hangs or refuses never fails the rollout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from kuberl.inference.engine import TorchEngine
from kuberl.inference.server import build_app
from kuberl.local.processes import free_port
from kuberl.models.tiny import char_tokenizer, tiny_qwen2
from kuberl.rollout.client import InferenceClient, Rejected, ReplicaFault
from kuberl.weights.sync import to_safetensors

TOKEN = "test-token-0123456789"


async def start_servers(n: int, tok, never_stop: bool = False):
    servers = []
    for i in range(n):
        engine = TorchEngine(tiny_qwen2(len(tok), seed=0), -1 if never_stop else tok.eos_token_id, tok.pad_token_id,
                             seed=i)
        server = TestServer(build_app(engine, tok, TOKEN))
        await server.start_server()
        servers.append((server, engine))
    return servers


async def test_weight_update_under_heavy_load_does_not_deadlock():
    """Regression: >100 generate requests parked on a paused replica used to starve /resume of a
    connection (aiohttp's pool limit), stalling training for the full request timeout."""
    tok = char_tokenizer()
    servers = await start_servers(1, tok, never_stop=True)
    new_weights = to_safetensors(tiny_qwen2(len(tok), seed=9).state_dict())
    try:
        async with InferenceClient([str(s.make_url("/")) for s, _ in servers], TOKEN, timeout=60) as client:
            prompt = [tok.bos_token_id, *tok("1+2=", add_special_tokens=False).input_ids]
            await client.pause_all()
            jobs = [asyncio.create_task(client.generate(prompt, 1, 6, 1.0, 1.0)) for _ in range(150)]
            await asyncio.sleep(0.5)  # all 150 are now parked on the paused server
            await asyncio.wait_for(client.push_weights(new_weights, 1), timeout=10)
            await asyncio.wait_for(client.resume_all(), timeout=10)
            outs = await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)
        assert all(len(o[0].output_ids) == 6 and set(o[0].versions) == {1} for o in outs)
    finally:
        for s, _ in servers:
            await s.close()


async def test_aborted_requests_resume_on_the_same_replica_with_mixed_versions():
    tok = char_tokenizer()
    servers = await start_servers(2, tok, never_stop=True)
    blob = to_safetensors(tiny_qwen2(len(tok), seed=3).state_dict())
    try:
        async with InferenceClient([str(s.make_url("/")) for s, _ in servers], TOKEN) as client:
            prompt = [tok.bos_token_id, *tok("4+4=", add_special_tokens=False).input_ids]
            jobs = [asyncio.create_task(client.generate(prompt, 2, 200, 1.0, 1.0)) for _ in range(4)]
            while sum(e.generated_tokens for _, e in servers) < 40:
                await asyncio.sleep(0.005)
            await client.pause_all()
            await client.push_weights(blob, 1)
            await client.resume_all()
            outs = [o for group in await asyncio.gather(*jobs) for o in group]
        assert all(len(o.output_ids) == 200 == len(o.logprobs) == len(o.versions) for o in outs)
        assert any(o.resumed for o in outs)
        for o in outs:  # versions never go backwards within a sample
            assert o.versions == sorted(o.versions) and o.versions[-1] == 1
        assert all(e.generated_tokens > 0 for _, e in servers)  # both replicas got work
    finally:
        for s, _ in servers:
            await s.close()


def answering_500() -> web.Application:
    """A replica whose engine is broken behind a live HTTP server: every route answers 500."""
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="engine step failed")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fail)
    return app


async def test_a_replica_answering_500_leaves_rotation_and_the_rollout_goes_on_with_the_other():
    tok = char_tokenizer()
    broken = TestServer(answering_500())
    await broken.start_server()
    (good, engine), = await start_servers(1, tok)
    try:
        async with InferenceClient([str(broken.make_url("/")), str(good.make_url("/"))], TOKEN) as client:
            prompt = [tok.bos_token_id, *tok("2+3=", add_special_tokens=False).input_ids]
            outs = await asyncio.wait_for(asyncio.gather(*(client.generate(prompt, 2, 5, 1.0, 1.0)
                                                           for _ in range(12))), timeout=30)
            assert client.replicas[0].needs_weights and not client.replicas[1].needs_weights
        assert all(len(group) == 2 and all(o.output_ids for o in group) for group in outs)
        assert engine.generated_tokens == sum(len(o.output_ids) for group in outs for o in group)
    finally:
        await broken.close()
        await good.close()


def answering_impossible(kind: str, vocab: int) -> web.Application:
    """A replica whose engine answers 200 with output the model cannot have produced: a token id past
    its vocabulary, routes for a dense model, the wrong number of generations, or a malformed body."""
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def generate(request: web.Request) -> web.Response:
        n = (await request.json())["n"]
        out = {"output_ids": [1, vocab + 7], "logprobs": [-0.1, -0.2], "versions": [0, 0], "finish_reason": "stop"}
        if kind == "routes":
            out = {**out, "output_ids": [1, 2], "routes": {"shape": [3, 1, 1], "data": "AAABAAIA"}}
        outputs = [out] * (n + 1 if kind == "count" else n)
        return web.json_response({"version": 0, "outputs": outputs} if kind != "malformed" else {"version": "x"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    return app


@pytest.mark.parametrize("kind", ["vocabulary", "routes", "count", "malformed"])
async def test_a_reply_the_model_cannot_have_made_is_its_replicas_fault_and_goes_elsewhere(kind):
    """Issue 69, item 7: a replica answering ids past the vocabulary (a device-side assert in the
    trainer's embedding on a GPU), routes the model has no experts for, or a malformed reply leaves
    rotation like a 500; its requests are answered by the other replica, within the model's limits."""
    from kuberl.inference.contract import ReplyLimits

    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)
    limits = ReplyLimits.of(model)
    assert limits == ReplyLimits(len(tok))  # a dense model: no experts
    broken = TestServer(answering_impossible(kind, limits.vocab_size))
    await broken.start_server()
    (good, engine), = await start_servers(1, tok)
    try:
        async with InferenceClient([str(broken.make_url("/")), str(good.make_url("/"))], TOKEN,
                                   limits=limits) as client:
            prompt = [tok.bos_token_id, *tok("2+3=", add_special_tokens=False).input_ids]
            outs = await asyncio.wait_for(asyncio.gather(*(client.generate(prompt, 2, 5, 1.0, 1.0)
                                                           for _ in range(6))), timeout=30)
            assert client.replicas[0].needs_weights and not client.replicas[1].needs_weights
        assert all(len(group) == 2 and all(max(o.output_ids) < limits.vocab_size and o.routes is None
                                           for o in group) for group in outs)
        assert engine.generated_tokens == sum(len(o.output_ids) for group in outs for o in group)
    finally:
        await broken.close()
        await good.close()


def test_reply_limits_of_a_mixture_of_experts_check_layers_k_and_experts():
    from kuberl.inference.contract import GenerateReply, Generation, ReplyLimits
    from kuberl.models.tiny import tiny_qwen3_moe

    model = tiny_qwen3_moe(40, seed=0)
    limits = ReplyLimits.of(model)
    assert limits.moe_layers > 0 and limits.top_k > 0 and limits.experts > limits.top_k

    def reply(routes: torch.Tensor) -> GenerateReply:
        return GenerateReply(0, [Generation([1, 2], [-0.1, -0.1], [0, 0], "stop", routes=routes)])

    fine = torch.zeros(4, limits.moe_layers, limits.top_k, dtype=torch.int16)
    assert limits.problem(reply(fine), 1, 3) is None
    assert limits.problem(reply(fine.clone().fill_(-1)), 1, 3) is None  # unknown routes
    assert "experts outside" in limits.problem(reply(fine + limits.experts), 1, 3)
    assert "shape" in limits.problem(reply(fine[:, :-1]), 1, 3)  # a layer short
    assert "shape" in limits.problem(reply(torch.zeros(9, limits.moe_layers, limits.top_k)), 1, 3)  # too many


async def test_requests_on_a_hung_replica_move_to_a_healthy_one():
    tok = char_tokenizer()
    release = threading.Event()
    hung_model = tiny_qwen2(len(tok), seed=0)
    hung_model.register_forward_pre_hook(lambda *_: release.wait(60) and None)
    hung = TorchEngine(hung_model, tok.eos_token_id, tok.pad_token_id, stall_seconds=0.5)
    hung_server = TestServer(build_app(hung, tok, TOKEN))
    await hung_server.start_server()
    (good, engine), = await start_servers(1, tok)
    try:
        async with InferenceClient([str(hung_server.make_url("/")), str(good.make_url("/"))], TOKEN,
                                   health_interval=0.2, health_timeout=2.0) as client:
            client.replicas[1].in_flight = 1  # the first request goes to the hung replica
            prompt = [tok.bos_token_id, *tok("2+3=", add_special_tokens=False).input_ids]
            (out,) = await asyncio.wait_for(client.generate(prompt, 1, 4, 1.0, 1.0), timeout=30)
            client.replicas[1].in_flight = 0
            assert client.replicas[0].needs_weights  # out of rotation
        assert out.output_ids and engine.generated_tokens == len(out.output_ids) and hung.generated_tokens == 0
    finally:
        release.set()
        await hung_server.close()
        await good.close()


async def test_a_request_the_replica_refuses_is_raised_at_once_not_retried():
    tok = char_tokenizer()
    (server, engine), = await start_servers(1, tok)
    try:
        async with InferenceClient([str(server.make_url("/"))], TOKEN) as client:
            with pytest.raises(Rejected) as err:
                await asyncio.wait_for(client.generate([5] * engine.max_model_len, 1, 4, 1.0, 1.0), timeout=10)
            assert err.value.status == 400 and "input_ids" in err.value.reason
            assert not client.replicas[0].needs_weights  # the replica is fine: it stays in rotation
    finally:
        await server.close()


async def test_a_replica_still_starting_is_waited_for_not_taken_out_of_rotation():
    """Before a replica's server listens, the health probes find nobody: that is a replica starting
    (vLLM takes a minute), not one that failed — it must not lose its place (in p2p mode a replica
    out of rotation waits for weights only the trainer can send)."""
    tok = char_tokenizer()
    port = free_port()
    async with InferenceClient([f"http://127.0.0.1:{port}"], TOKEN, health_interval=0.05) as client:
        await asyncio.sleep(0.5)  # ten probes find nothing listening
        engine = TorchEngine(tiny_qwen2(len(tok), seed=0), tok.eos_token_id, tok.pad_token_id)
        server = TestServer(build_app(engine, tok, TOKEN), port=port)
        await server.start_server()
        try:
            await client.wait_ready(timeout=30)
            await asyncio.sleep(0.3)  # and a few more that find it healthy
            assert not client.replicas[0].needs_weights
        finally:
            await server.close()


def slow_to_take_weights(release: asyncio.Event) -> web.Application:
    """A replica whose server answers its health check but never finishes taking a weight version."""
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": 0})

    async def update(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"version": 1})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/update_weights", update)
    return app


async def test_a_replica_that_straggles_on_a_weight_push_leaves_rotation_and_the_push_ends():
    """The push ends STRAGGLER_FLOOR after the healthy replica took the version — it does not wait for
    the one that hangs — and the healthy one serves the new weights; the push's receipt says so."""
    tok = char_tokenizer()
    release = asyncio.Event()
    hung = TestServer(slow_to_take_weights(release))
    await hung.start_server()
    (good, engine), = await start_servers(1, tok)
    new_model = tiny_qwen2(len(tok), seed=9)
    try:
        async with InferenceClient([str(hung.make_url("/")), str(good.make_url("/"))], TOKEN) as client:
            receipt = await asyncio.wait_for(client.push_weights(to_safetensors(new_model.state_dict()), 1), timeout=10)
            assert client.replicas[0].needs_weights and not client.replicas[1].needs_weights
            hung_url, good_url = (r.url for r in client.replicas)  # the receipt: who took it, who left and why
            assert list(receipt.served) == [good_url] and 0 < receipt.served[good_url] < 10
            assert list(receipt.lost) == [hung_url] and "its peers were" in receipt.lost[hung_url]
            prompt = [tok.bos_token_id, *tok("2+3=", add_special_tokens=False).input_ids]
            (out,) = await asyncio.wait_for(client.generate(prompt, 1, 6, 0.0, 1.0), timeout=30)
        assert engine.version == 1 and set(out.versions) == {1}
        expected = new_model.generate(torch.tensor([prompt]), max_new_tokens=len(out.output_ids), do_sample=False,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert out.output_ids == expected[0, len(prompt):].tolist()  # the new policy is the one served
    finally:
        release.set()
        await hung.close()
        await good.close()


async def test_a_weight_push_no_replica_takes_ends_at_the_exchanges_time_limit_naming_the_replica():
    """A replica that answers /health but never takes the version: the push ends at weightSync.timeoutSeconds
    (here 1 s), the replica leaves rotation and the receipt says why — never a silent hang."""
    release = asyncio.Event()
    hung = TestServer(slow_to_take_weights(release))
    await hung.start_server()
    try:
        async with InferenceClient([str(hung.make_url("/"))], TOKEN, push_timeout=1.0) as client:
            start = time.monotonic()
            receipt = await asyncio.wait_for(client.push_weights(b"weights", 1), timeout=30)
            assert 1.0 <= time.monotonic() - start < 10
            assert receipt.served == {} and client.replicas[0].needs_weights
            assert "not done within weightSync.timeoutSeconds (1 s)" in receipt.lost[client.replicas[0].url]
    finally:
        release.set()
        await hung.close()


def relaying_replica(dies: bool, release: asyncio.Event) -> web.Application:
    """A replica in a relayed p2p exchange: one that ``dies`` fails to take the version at once; the
    others wait on what it should have forwarded (until ``release``)."""
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": 0})

    async def topology(request: web.Request) -> web.Response:
        return web.json_response({"node": "n0", "fabric": "", "zone": ""})

    async def receive(request: web.Request) -> web.Response:
        if dies:
            raise web.HTTPInternalServerError(text="the exchange group broke")
        await release.wait()
        return web.json_response({"version": int(request.query["version"]), "seconds": 0.0})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/topology", topology)
    app.router.add_post("/weights/p2p/receive", receive)
    return app


@pytest.mark.parametrize("relayed", [True, False])
async def test_a_relayed_p2p_exchange_ends_at_the_first_failure_and_the_waiting_peers_stay_in_rotation(relayed):
    """Relayed, the replicas wait on each other: when one fails the exchange ends for all at once —
    none took the version (the trainer then broadcasts it), and the two that waited stay in rotation.
    Direct, the others could still finish on their own, so the exchange waits for them."""
    release = asyncio.Event()
    servers = [TestServer(relaying_replica(i == 0, release)) for i in range(3)]
    for server in servers:
        await server.start_server()
    try:
        async with InferenceClient([str(s.make_url("/")) for s in servers], TOKEN) as client:
            await client.topologies()
            if relayed:
                with pytest.raises(ReplicaFault, match="no replica received"):
                    await asyncio.wait_for(client.receive_p2p(1, relayed=True), timeout=10)
                assert [r.needs_weights for r in client.replicas] == [True, False, False]
            else:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(client.receive_p2p(1), timeout=1)
    finally:
        release.set()
        for server in servers:
            await server.close()


async def test_a_replica_that_keeps_failing_stays_out_longer_each_time():
    """Back-off 1, 2, 4 s … while it answers 500; one request served resets it."""
    broken = TestServer(answering_500())
    await broken.start_server()
    try:
        async with InferenceClient([str(broken.make_url("/"))], TOKEN) as client:
            replica = client.replicas[0]
            waits = []
            for _ in range(4):
                replica.needs_weights, replica.down_until = False, 0.0  # as if back with the newest weights
                request = asyncio.create_task(client.generate([1, 2], 1, 2, 1.0, 1.0))
                while not replica.needs_weights:  # until its 500 took it out of rotation
                    await asyncio.sleep(0.01)
                waits.append(replica.down_until - time.monotonic())
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
        assert [round(w) for w in waits] == [1, 2, 4, 8] and replica.failures == 4
    finally:
        await broken.close()
