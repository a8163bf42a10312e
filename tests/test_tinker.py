"""The Tinker-compatible front door's pieces (kuberl.tinker): its bodies read both ways with the real ``tinker``
SDK's own encoders, its losses as their formulas, shared base tensors, limits and the token budget, saved states
(on a directory and a real HTTP S3), keys, round-robin work, sessions. The server driven by the SDK is in
tests/test_tinker_sdk.py."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from kuberl.api.spec import ModelSource
from kuberl.checkpoint.store import LocalStore, open_store
from kuberl.settings import DEFAULTS
from kuberl.tinker import losses, wire
from kuberl.tinker.budget import TokenBudget
from kuberl.tinker.errors import Busy, ClientError, Gone, NotFound
from kuberl.tinker.futures import FutureTable
from kuberl.tinker.sampler import SampleParams
from kuberl.tinker.serve import served_model
from kuberl.tinker.server import owner_of
from kuberl.tinker.service import Limits, ServedModel, TinkerService
from kuberl.tinker.states import StateStore, state_path
from kuberl.tinker.trainee import AdapterShape, Trainee
from kuberl_cli.serve import ServeError, client_names, read_keys

BASE = "builtin:tiny-qwen2"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples/cpu-tiny.yaml"  # its model is BASE
SEQUENCE = [5, 9, 14, 20, 27, 35, 44]
ALICE, BOB = "tml-alice-" + "a" * 30, "tml-bob-" + "b" * 30


# -- the wire --------------------------------------------------------------------------------------------
def test_the_sdks_forward_backward_request_reads_as_its_tokens_inputs_and_config() -> None:
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "advantages": [0.5, -1.0, 2.0],
                                        "weights": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"}),
        model_id="model-1", seq_id=9)
    call = wire.decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("model-1", 9, "ppo", False)
    assert call.config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}
    (got,) = call.data
    assert got.tokens == [5, 6, 7]
    assert got.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert got.inputs["advantages"].tolist() == [0.5, -1.0, 2.0]
    # the SDK sends a mostly-zero 2-D weights tensor as sparse CSR; it arrives dense
    assert got.inputs["weights"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]


def test_a_body_that_is_not_a_request_is_refused_saying_so() -> None:
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff")


def test_the_sdk_reads_our_forward_backward_output_and_sample_response() -> None:
    out = deserialize_forward_backward_output(wire.encode_forward_backward_output(
        [{"logprobs": np.array([-1.0, -2.0, -3.0])}, {"logprobs": np.array([-4.0])}], {"loss:sum": 3.5}))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-4.0]]
    assert out.metrics == {"loss:sum": 3.5}
    sample = deserialize_sample_response(wire.encode_sample_response(
        [wire.SequenceOut([1, 2], [-0.5, -0.25], stopped=True), wire.SequenceOut([3], [-1.5], stopped=False)],
        [math.nan, -1.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([1, 2], [-0.5, -0.25], "stop"), ([3], [-1.5], "length")]
    assert sample.prompt_logprobs == [None, -1.0]


# -- the losses ------------------------------------------------------------------------------------------
def _grad(loss: losses.LossFn, logp: list[float], **inputs: list[float]) -> list[float]:
    x = torch.tensor(logp, requires_grad=True)
    loss(x, {k: torch.tensor(v) for k, v in inputs.items()}, {}).backward()
    assert x.grad is not None
    return x.grad.tolist()


def test_cross_entropy_and_importance_sampling_are_their_formulas() -> None:
    logp = [math.log(0.5), math.log(0.25)]
    x = torch.tensor(logp)
    assert float(losses.cross_entropy(x, {"weights": torch.tensor([1.0, 2.0])}, {})) == pytest.approx(
        -(math.log(0.5) + 2 * math.log(0.25)))
    # at the sampler's own policy (ratio 1) the importance-sampled gradient is the policy gradient −A
    assert _grad(losses.importance_sampling, logp, logprobs=logp, advantages=[2.0, -1.0]) == pytest.approx([-2.0, 1.0])


def test_ppo_stops_the_gradient_where_the_ratio_left_the_clip_range_in_the_advantages_direction() -> None:
    q = [0.0, 0.0, 0.0, 0.0]
    logp = [math.log(1.5), math.log(1.1), math.log(0.5), math.log(1.5)]  # ratios 1.5, 1.1, 0.5, 1.5
    grads = _grad(losses.ppo, logp, logprobs=q, advantages=[1.0, 1.0, -1.0, -1.0])
    # 1.5 > 1.2 with A > 0: clipped, no gradient; 1.1 inside: −r·A; 0.5 < 0.8 with A < 0: clipped;
    # 1.5 with A < 0: the unclipped term is the smaller one, so it keeps its gradient −r·A
    assert grads == pytest.approx([0.0, -1.1, 0.0, 1.5])


def test_cispo_weights_the_log_likelihood_by_the_clipped_ratio_without_a_gradient_through_it() -> None:
    grads = _grad(losses.cispo, [math.log(2.0), math.log(1.0)], logprobs=[0.0, 0.0], advantages=[1.0, -3.0])
    assert grads == pytest.approx([-1.2, 3.0])


def test_loss_inputs_that_do_not_fit_are_refused_naming_the_input() -> None:
    inputs = {"target_tokens": torch.tensor([1, 2, 99]), "weights": torch.ones(3)}
    with pytest.raises(ClientError, match=r"data\[4\].loss_fn_inputs.target_tokens: ids must lie in \[0, 50\)"):
        losses.checked_inputs("cross_entropy", inputs, 3, 50, 4)
    with pytest.raises(ClientError, match=r"target_tokens: shape \[3\]; the datum has 2 tokens"):
        losses.checked_inputs("cross_entropy", inputs, 2, 100, 0)
    with pytest.raises(ClientError, match=r"loss 'ppo' needs \['logprobs', 'advantages'\]"):
        losses.checked_inputs("ppo", inputs, 3, 100, 0)
    with pytest.raises(ClientError, match="'dro' is not served here; choose one of"):
        losses.loss_named("dro")


def test_lora_models_share_the_base_tensors_and_training_one_changes_neither_the_base_nor_another() -> None:
    served = served_model(ModelSource(path=BASE), 0, DEFAULTS)
    alice, bob = (Trainee(served.module, AdapterShape(4), served.pad_id, seed) for seed in (1, 2))
    base_pointers = {t.data_ptr() for t in served.module.parameters()}
    for trainee in (alice, bob):
        assert base_pointers <= {t.data_ptr() for t in trainee.model.parameters()}  # no second copy of the base
    call = wire.ForwardBackwardCall("m", 1, "cross_entropy", [wire.DatumIn(
        SEQUENCE[:-1], {"target_tokens": np.array(SEQUENCE[1:]), "weights": np.ones(6, dtype=np.float32)})],
                                    forward_only=True)
    before = {name: t.forward_backward(call)[0][0]["logprobs"] for name, t in (("alice", alice), ("bob", bob))}
    base_before = [t.clone() for t in served.module.parameters()]
    alice.forward_backward(dataclasses.replace(call, forward_only=False))
    alice.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(base_before, served.module.parameters(), strict=True))
    assert np.array_equal(bob.forward_backward(call)[0][0]["logprobs"], before["bob"])
    assert not np.allclose(alice.forward_backward(call)[0][0]["logprobs"], before["alice"])


def test_a_client_over_its_share_of_queued_work_is_told_to_retry_and_another_is_not() -> None:
    service = TinkerService(ServedModel(BASE, torch.nn.Linear(2, 2), 0, 0, str), limits=Limits(queued_per_client=2))
    alice, bob = service.create_session("alice"), service.create_session("bob")
    for seq in (0, 1):  # the worker is not started: the work stays queued
        service.create_model("alice", alice, seq, BASE, AdapterShape(2))
    with pytest.raises(Busy, match="2 training requests of yours are waiting"):
        service.create_model("alice", alice, 2, BASE, AdapterShape(2))
    service.create_model("bob", bob, 0, BASE, AdapterShape(2))


def test_a_clients_token_budget_refills_at_its_rate_and_says_when_to_retry() -> None:
    now = [0.0]
    budget = TokenBudget(600, lambda: now[0])  # 10 tokens a second, at most 600
    budget.take("alice", 500)
    with pytest.raises(Busy, match="600 tokens a minute is your share here; this request needs 200") as busy:
        budget.take("alice", 200)
    assert busy.value.retry_after == pytest.approx(10.0)  # 100 held, 200 needed, 10 a second
    budget.take("bob", 600)  # another client's bucket is its own
    now[0] = 10.0
    budget.take("alice", 200)
    budget.give_back("alice", 50)  # a sample that stopped early
    assert budget.level("alice") == pytest.approx(50.0)
    now[0] = 1000.0
    assert budget.level("alice") == 600.0  # full, never more
    budget.take("alice", 5000)  # larger than a minute's worth: admitted from a full bucket, into debt
    with pytest.raises(Busy) as busy:
        budget.take("alice", 1)
    assert busy.value.retry_after == pytest.approx(440.1)


def test_a_state_path_stays_inside_its_clients_prefix() -> None:
    for bad in ("..", ".", "a/b", ""):
        with pytest.raises(ClientError, match="a state's name is"):
            state_path("session-1:train:0", bad)
    store = StateStore(LocalStore(Path("/nonexistent")))
    for bad in ("tinker://../weights/x", "tinker://m/weights/..", "tinker://m/other/x", "s3://b/k"):
        with pytest.raises(ClientError, match="a state is tinker://MODEL/weights/NAME"):
            store.load("alice", bad)


def test_a_clients_states_of_one_model_are_listed_and_deleted_and_no_one_elses(uri: str) -> None:
    from kuberl.tinker.states import TrainingState

    states, tensors = StateStore(open_store(uri)), {"w": torch.ones(3)}  # a directory, and a real HTTP S3
    for owner, model, name in (("alice", "s:train:1", "a"), ("alice", "s:train:1", "b"), ("alice", "s:train:10", "c"),
                               ("bob", "s:train:1", "d")):
        states.save(owner, state_path(model, name), TrainingState(BASE, None, tensors, {}, 1), False)
    listed = states.saved("alice", "s:train:1")
    assert sorted(s.path for s in listed) == [state_path("s:train:1", "a"), state_path("s:train:1", "b")]
    assert all(s.size_bytes > 0 and s.saved_at > 0 for s in listed)
    states.delete("alice", state_path("s:train:1", "a"))
    assert [s.path for s in states.saved("alice", "s:train:1")] == [state_path("s:train:1", "b")]
    assert [s.path for s in states.saved("bob", "s:train:1")] == [state_path("s:train:1", "d")]
    with pytest.raises(NotFound, match="no such state of yours"):
        states.delete("bob", state_path("s:train:1", "b"))
    with pytest.raises(ClientError, match="not a model id"):
        states.saved("alice", "..")


def test_a_state_past_its_ttl_is_neither_listed_nor_loaded_and_its_files_go(uri: str) -> None:
    from kuberl.tinker.states import Keeping, TrainingState

    store = open_store(uri)
    states, state = StateStore(store), TrainingState(BASE, None, {"w": torch.ones(3)}, {}, 1)
    old, kept = state_path("m", "old"), state_path("m", "kept")
    states.save("alice", old, state, False, Keeping(expires_at=time.time() - 1))  # expired a second ago
    states.save("alice", kept, state, False, Keeping.from_ttl(3600, {"run": "a"}))
    assert [(s.path, s.keeping.user_metadata) for s in states.saved("alice", "m")] == [(kept, {"run": "a"})]
    assert not any("/old/" in key for key in store.list())  # looked at once, deleted
    with pytest.raises(ClientError, match="no such state of yours"):
        states.load("alice", old)
    [listed] = states.saved("alice", "m")
    assert listed.keeping.expires_at is not None and listed.keeping.expires_at > time.time() + 3000
    states.set_ttl("alice", kept, None)
    assert states.saved("alice", "m")[0].keeping.expires_at is None  # kept until deleted
    states.load("alice", kept)


# -- keys and fairness -----------------------------------------------------------------------------------
def test_a_key_names_its_client_and_anything_else_names_none() -> None:
    keys = {ALICE: "alice", BOB: "bob"}
    assert [owner_of(k, keys) for k in (ALICE, BOB, ALICE[:-1], None, "tml-\udcff")] == ["alice", "bob", None,
                                                                                         None, None]


def test_training_work_is_taken_round_robin_over_clients_in_each_clients_order() -> None:
    service = TinkerService(ServedModel(BASE, torch.nn.Linear(2, 2), 0, 0, str))

    async def nothing() -> Any:
        return None

    ids = [service._submit(owner, nothing) for owner in ("alice", "alice", "alice", "bob", "carol", "bob")]
    taken = []
    while (item := service._next_work()) is not None:
        taken.append(ids.index(item[1]))
    assert taken == [0, 3, 4, 1, 5, 2]  # alice, bob, carol, alice, bob, alice



# -- kuberl serve ----------------------------------------------------------------------------------------
def test_a_keys_file_names_each_client_and_refuses_a_key_the_sdk_would_refuse(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"alice": ALICE, "bob": BOB}))
    assert read_keys(keys) == {ALICE: "alice", BOB: "bob"}
    keys.write_text(json.dumps({"alice": ALICE, "bob": "sk-" + "b" * 40}))
    with pytest.raises(ServeError, match="bob's key must be a string starting 'tml-'"):
        read_keys(keys)
    keys.write_text(json.dumps({"alice": ALICE, "bob": ALICE}))
    with pytest.raises(ServeError, match="two clients share a key"):
        read_keys(keys)
    with pytest.raises(ServeError, match="--clients 'a,a'"):
        client_names("a,a")


def test_keys_read_from_a_secret_mounted_as_a_volume(tmp_path: Path) -> None:
    """The kubelet's layout: each key a symlink into the newest ``..data`` directory (a timestamped one)."""
    mounted = tmp_path / "keys"
    (mounted / "..2026_11_30_02_00_00.1").mkdir(parents=True)
    for client, key in (("alice", ALICE), ("bob", BOB + "\n")):
        (mounted / "..2026_11_30_02_00_00.1" / client).write_text(key)
    (mounted / "..data").symlink_to("..2026_11_30_02_00_00.1")
    for client in ("alice", "bob"):
        (mounted / client).symlink_to(f"..data/{client}")
    assert read_keys(mounted) == {ALICE: "alice", BOB: "bob"}  # a trailing newline is not part of a key
    (mounted / "..2026_11_30_02_00_00.1" / "carol").write_text("short")
    (mounted / "carol").symlink_to("..data/carol")
    with pytest.raises(ServeError, match="carol's key must be a string starting 'tml-'"):
        read_keys(mounted)


@pytest.mark.asyncio
async def test_a_session_without_heartbeats_is_finished_and_its_models_released() -> None:
    now = [0.0]
    service = TinkerService(served_model(ModelSource(path=BASE), 0, DEFAULTS), FutureTable(poll_seconds=30),
                            Limits(session_expiry_seconds=300), clock=lambda: now[0])
    service.start()
    try:
        quiet, alive = service.create_session("alice"), service.create_session("alice")
        made = [service.create_model("alice", s, 0, BASE, AdapterShape(2)) for s in (quiet, alive)]
        outcomes = [await service.futures.retrieve(r, "alice") for r in made]
        assert [o.error if o else "not done" for o in outcomes] == [None, None]
        now[0] = 200.0
        service.heartbeat("alice", alive)
        now[0] = 301.0
        assert await service.reap() == [quiet]
        assert [m.session for m in service.models.values()] == [alive]
        with pytest.raises(Gone, match=r"has finished .*no heartbeat for 300 s"):
            service.heartbeat("alice", quiet)
        with pytest.raises(NotFound):  # another client's finished session is still not its business
            service.heartbeat("bob", quiet)
        sample = generate_latest(service.metrics.registry).decode()
        assert 'kuberl_tinker_models{client="alice"} 1.0' in sample
        assert 'kuberl_tinker_sessions{client="alice"} 1.0' in sample
    finally:
        await service.stop()


@pytest.mark.asyncio
async def test_samples_and_passes_spend_the_clients_token_budget_and_a_sample_returns_what_it_did_not_use() -> None:
    """A sample reserves prompt + n × max_tokens of its client's budget, over it the client is told when to
    retry (the server's 429 Retry-After), and what the sample did not generate (its stop token) comes back; a
    forward/backward pass costs its tokens."""
    now = [0.0]
    service = TinkerService(served_model(ModelSource(path=BASE), 0, DEFAULTS), FutureTable(poll_seconds=30),
                            Limits(tokens_per_minute=60), clock=lambda: now[0])  # a token a second
    service.start()
    try:
        session = service.create_session("alice")
        sampler = await service.create_sampling_session("alice", session, BASE, None)
        stop_at_once = SampleParams(max_tokens=20, stop_tokens=tuple(range(100)))  # every token is a stop token
        done = service.sample("alice", sampler, [5, 6], 2, stop_at_once, False)  # reserves 2 + 40
        with pytest.raises(Busy, match="this request needs 42 and your budget holds 18") as busy:
            service.sample("alice", sampler, [5, 6], 2, stop_at_once, False)
        assert busy.value.retry_after == pytest.approx(24.0)
        outcome = await service.futures.retrieve(done, "alice")
        assert outcome is not None and outcome.error is None
        assert service.budget is not None and service.budget.level("alice") == pytest.approx(60 - 2 - 2)
        made = await service.futures.retrieve(service.create_model("alice", session, 0, BASE, AdapterShape(2)), "alice")
        assert made is not None and made.json is not None
        tokens = [5, 6, 7] * 10
        datum = wire.DatumIn(tokens, {"target_tokens": np.array([*tokens[1:], 5]), "weights": np.ones(30, np.float32)})
        service.forward_backward("alice", wire.ForwardBackwardCall(made.json["model_id"], 0, "cross_entropy", [datum]))
        assert service.budget.level("alice") == pytest.approx(56 - 30)  # a pass costs its tokens
        with pytest.raises(Busy, match="needs 30 and your budget holds 26"):
            service.forward_backward("alice", wire.ForwardBackwardCall(made.json["model_id"], 1, "cross_entropy",
                                                                       [datum]))
    finally:
        await service.stop()
