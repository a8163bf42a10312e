"""Bring-your-own data: verl- and TRL-style tables through the ``datasets`` library (chat-list prompts,
nested answers, the other columns for the reward, length filtering), and chat templates: the token ids
the policy is sampled and trained on are the tokenizer's own rendering."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp.test_utils import TestServer

from kuberl.api.spec import ChatTemplateSpec, DatasetSource, ModelSource
from kuberl.data.datasets import DatasetError, DropCount, evaluation_examples, examples
from kuberl.data.tables import local_file_issues, peek_columns
from kuberl.inference.engine import TorchEngine
from kuberl.inference.server import build_app
from kuberl.models.loading import load_tokenizer
from kuberl.models.text import TextCodec
from kuberl.models.tiny import tiny_qwen2
from kuberl.rewards.pool import InlineScorer
from kuberl.rollout.client import InferenceClient
from kuberl.rollout.workflow import RLVRWorkflow, WorkflowContext
from kuberl.settings import DEFAULTS, Settings

from .hf_model import write_hf_model

TOKEN = "test-token-0123456789"
QWEN3_LIKE = (  # the shape of Qwen3's template: a system turn, and an empty think block when thinking is off
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def verl_rows(n: int) -> list[dict[str, Any]]:
    return [{"data_source": "unit", "prompt": [{"role": "user", "content": f"what is {i}+{i}?" + " pad" * (i % 5)}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
            for i in range(n)]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache")


def test_a_verl_parquet_file_gives_chat_prompts_nested_answers_and_its_other_columns(tmp_path, settings):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(20)), path)
    source = DatasetSource(path=f"file://{path}", answerKey="reward_model.ground_truth")
    stream = list(itertools.islice(examples(source, seed=3, settings=settings), 40))
    first_epoch = stream[:20]
    assert sorted(int(e.answer) for e in first_epoch) == [2 * i for i in range(20)]  # a permutation of the rows
    for example in first_epoch:
        (message,) = example.prompt
        i = example.row["extra_info"]["index"]
        assert message == {"role": "user", "content": f"what is {i}+{i}?" + " pad" * (i % 5)}
        assert example.answer == str(2 * i)
        assert example.row["data_source"] == "unit" and example.row["reward_model"]["style"] == "rule"
        assert "prompt" not in example.row
    assert stream[7:15] == list(itertools.islice(examples(source, seed=3, position=7, settings=settings), 8))
    assert [e.answer for e in evaluation_examples(source, 3, seed=0, settings=settings)] == ["0", "2", "4"]


def test_a_trl_style_jsonl_with_a_messages_column_and_a_json_array(tmp_path, settings):
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}+1="}],
             "answer": i + 1, "tests": [i]} for i in range(6)]
    jsonl, array = tmp_path / "trl.jsonl", tmp_path / "trl.json"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array.write_text(json.dumps(rows))
    for path in (jsonl, array):
        got = list(itertools.islice(examples(DatasetSource(path=str(path), promptKey="messages"), 0,
                                             settings=settings), 6))
        assert sorted(e.answer for e in got) == [str(i + 1) for i in range(6)]  # numbers become text
        assert all(e.prompt[0]["role"] == "system" and e.row["tests"] == [int(e.answer) - 1] for e in got)


def test_table_errors_name_the_field_the_row_or_the_column(tmp_path, settings):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": {"text": "1+1="}, "a": "2"}) + "\n")
    with pytest.raises(DatasetError, match=r"spec\.dataset\.answerKey: the table has no column 'answer'; it has: a, "
                                           r"q, q\.text"):
        next(examples(DatasetSource(path=str(path), promptKey="q.text"), 0, settings=settings))
    with pytest.raises(DatasetError, match=r"row 0, promptKey 'q': a prompt is text or a list of \{role, content\}"):
        next(examples(DatasetSource(path=str(path), promptKey="q", answerKey="a"), 0, settings=settings))
    (tmp_path / "d.csv").write_text("q,a\n")
    with pytest.raises(DatasetError, match=r"a \.jsonl, \.json, \.parquet file is needed"):
        next(examples(DatasetSource(path=str(tmp_path / "d.csv")), 0, settings=settings))


def test_rows_the_filter_refuses_are_skipped_deterministically_and_counted_once(tmp_path, settings):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(20)), path)
    source = DatasetSource(path=str(path), answerKey="reward_model.ground_truth")
    dropped = DropCount()
    short = [e for e in itertools.islice(examples(source, 1, settings=settings,
                                                  keep=lambda e: "pad" not in e.prompt[0]["content"],
                                                  dropped=dropped), 12)]
    assert sorted(int(e.answer) // 2 for e in short[:4]) == [0, 5, 10, 15]  # i % 5 == 0: no padding
    assert len(dropped) == 16  # 3 epochs went by; each long row counted once


def test_the_builtin_table_is_a_parquet_file_in_the_cache(settings):
    source = DatasetSource(path="builtin:chat-math", answerKey="reward_model.ground_truth")
    first = next(examples(source, 0, settings=settings))
    assert (settings.cache_dir / "builtin" / "chat-math.parquet").is_file()
    assert isinstance(first.prompt, tuple) and first.prompt[0]["role"] == "user"
    a, b = first.row["extra_info"]["a"], first.row["extra_info"]["b"]
    assert first.answer == str(a + b)


def test_validate_reads_a_local_files_columns_without_loading_it(tmp_path):
    parquet, jsonl = tmp_path / "t.parquet", tmp_path / "t.jsonl"
    pq.write_table(pa.Table.from_pylist(verl_rows(3)), parquet)
    jsonl.write_text(json.dumps({"prompt": "x", "meta": {"answer": "1"}}) + "\n")
    assert {"prompt", "reward_model.ground_truth", "extra_info.index"} <= peek_columns(parquet)
    assert peek_columns(jsonl) == {"prompt", "meta", "meta.answer"}
    ok = DatasetSource(path=f"file://{parquet}", answerKey="reward_model.ground_truth")
    assert local_file_issues(ok, "spec.dataset") == []
    assert local_file_issues(DatasetSource(path=str(jsonl)), "spec.evaluation.dataset") == [
        ("spec.evaluation.dataset.answerKey", "the table has no column 'answer'; it has: meta, meta.answer, prompt")]
    assert local_file_issues(DatasetSource(path="s3://b/k.parquet"), "spec.dataset") == []  # not here: not checked


@pytest.fixture
def chat_model_dir(tmp_path: Path) -> Path:
    return write_hf_model(tmp_path / "model")


def chat_spec(**changes: Any) -> ChatTemplateSpec:
    return ChatTemplateSpec.model_validate({"template": QWEN3_LIKE, "systemPrompt": "answer briefly",
                                            "kwargs": {"enable_thinking": False}, **changes})


def test_prompts_render_through_the_template_with_its_system_prompt_and_variables(chat_model_dir):
    tok = load_tokenizer(ModelSource(path=f"file://{chat_model_dir}", chatTemplate=chat_spec()), DEFAULTS)
    codec = TextCodec(tok, chat_spec())
    want_text = ("<|im_start|>system\nanswer briefly<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert codec.prompt_text("3+4=") == want_text
    assert codec.prompt_text(({"role": "user", "content": "3+4="},)) == want_text
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "3+4="}]
    want_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=False,
                                       return_dict=False)
    assert codec.encode_prompt("3+4=") == list(want_ids)
    raw = TextCodec(tok, ChatTemplateSpec(mode="off"))
    assert raw.encode_prompt("3+4=") == [tok.bos_token_id, *tok("3+4=", add_special_tokens=False).input_ids]
    with pytest.raises(ValueError, match=r"chat-list prompt needs a chat template.*spec\.model\.chatTemplate"):
        raw.encode_prompt(({"role": "user", "content": "3+4="},))


def test_mode_on_without_any_template_is_refused_naming_the_field():
    from kuberl.models.tiny import char_tokenizer

    with pytest.raises(ValueError, match=r"spec\.model\.chatTemplate\.mode is on but the tokenizer has no chat"):
        TextCodec(char_tokenizer(), ChatTemplateSpec(mode="on"))


async def test_the_policy_is_sampled_and_rewarded_on_the_templates_token_ids(chat_model_dir):
    """Through a real torch engine: the trajectory's prompt ids (what the engine was sent, and what the
    trainer trains on) are the tokenizer's own rendering, and the reward sees the rendered text."""
    tok = load_tokenizer(ModelSource(path=f"file://{chat_model_dir}", chatTemplate=chat_spec()), DEFAULTS)
    codec = TextCodec(tok, chat_spec())
    seen: list[str] = []

    def reward(prompt: str, completion: str, answer: str, **row: Any) -> float:
        seen.append(prompt)
        return float(row["extra_info"]["index"] == 7)

    engine = TorchEngine(tiny_qwen2(len(tok), seed=1).eval(), tok.eos_token_id, tok.pad_token_id, seed=0)
    server = TestServer(build_app(engine, tok, TOKEN))
    await server.start_server()
    workflow = RLVRWorkflow(WorkflowContext(
        encode_prompt=codec.encode_prompt, prompt_text=codec.prompt_text, encode_text=codec.encode_text,
        decode=codec.decode, eos_id=codec.eos_id, reward=InlineScorer(reward), group_size=2, max_new_tokens=4,
        temperature=1.0, top_p=1.0))
    from kuberl.data.example import Example

    example = Example(({"role": "user", "content": "3+4="},), "7", row={"extra_info": {"index": 7}})
    try:
        async with InferenceClient([str(server.make_url("/"))], TOKEN) as client:
            group = await workflow.run_episode(client, example, group_id=0)
    finally:
        await server.close()
    assert group is not None
    want = tok.apply_chat_template([{"role": "system", "content": "answer briefly"},
                                    {"role": "user", "content": "3+4="}], tokenize=True,
                                   add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert all(t.prompt_ids == list(want) for t in group.trajectories)
    assert seen == [codec.prompt_text(example.prompt)] * len(seen)
    finished = [t for t in group.trajectories if t.finish_reason == "stop"]
    assert [t.reward for t in finished] == [1.0] * len(finished)
