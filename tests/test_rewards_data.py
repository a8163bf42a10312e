"""Reward functions and datasets: hand-checked values, determinism, resumable positions, clear errors."""

from __future__ import annotations

import itertools
import json

import pytest

from kuberl.api.spec import DatasetSource
from kuberl.data.datasets import DatasetError, examples
from kuberl.rewards import digit_match, exact_match, load_reward


def test_exact_match():
    assert exact_match("1+1=", " 2 ", "2") == 1.0 and exact_match("1+1=", "3", "2") == 0.0


def test_digit_match_partial_credit_aligned_from_the_right():
    assert digit_match("", "579", "579") == 1.0
    assert digit_match("", "479", "579") == pytest.approx(2 / 3)
    assert digit_match("", "79", "579") == pytest.approx(2 / 3)
    assert digit_match("", "1579", "579") == pytest.approx(3 / 4)  # too long is penalised
    assert digit_match("", "", "579") == 0.0


def test_load_reward_errors_name_the_field():
    assert load_reward("kuberl.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match=r"spec\.reward\.function.*defines no 'nope'; KubeRL's rewards: exact_match"):
        load_reward("kuberl.rewards:nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward("no_such_module:f")


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic-2digit", "arithmetic-3digit"])
def test_builtin_datasets_are_deterministic_correct_and_resumable(name):
    source = DatasetSource(path=f"builtin:{name}")
    first = list(itertools.islice(examples(source, seed=1), 50))
    assert first == list(itertools.islice(examples(source, seed=1), 50))
    assert first[10:20] == list(itertools.islice(examples(source, seed=1, position=10), 10))
    for ex in first:
        assert ex.prompt.endswith("=") and eval(ex.prompt[:-1]) == int(ex.answer)


def test_jsonl_dataset_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+0=", "a": str(i)}) for i in range(5)) + "\n")
    source = DatasetSource(path=f"file://{path}", promptKey="q", answerKey="a")
    stream = list(itertools.islice(examples(source, seed=0), 10))
    assert sorted(e.answer for e in stream[:5]) == ["0", "1", "2", "3", "4"]  # each epoch is a permutation
    assert stream[3:8] == list(itertools.islice(examples(source, seed=0, position=3), 5))
    with pytest.raises(DatasetError, match=r"spec\.dataset\.promptKey: the table has no column 'prompt'; it has: a, q"):
        next(examples(DatasetSource(path=str(path)), seed=0))
    with pytest.raises(DatasetError, match="does not exist"):
        next(examples(DatasetSource(path=str(tmp_path / "missing.jsonl")), seed=0))
    with pytest.raises(DatasetError, match="builtin datasets: arithmetic"):
        next(examples(DatasetSource(path="builtin:nope"), seed=0))
