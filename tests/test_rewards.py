"""Rewards: the math reward's correctness table, the reward contract (row columns, async), and the
worker pool (a hung or failing reward scores 0, is counted, and stalls nothing else)."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import pytest

import kuberl.rewards as rewards
from kuberl.api.rewards import KUBERL_REWARDS, reward_issue
from kuberl.rewards import call_reward
from kuberl.rewards.pool import InlineScorer, RewardPool, make_scorer

# (completion, reference answer, paid?). The first four are the issue's: the regex reward paid the
# three wrong answers and refused the right one.
MATH_TABLE = [
    (r"so \boxed{\frac{3}{2}}", r"\frac{1}{2}", False),
    (r"\boxed{2\sqrt3}", r"4\sqrt3", False),
    (r"\boxed{x^2}", "y^2", False),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    # fractions, decimals, integers
    (r"\boxed{\dfrac{1}{2}}", "0.5", True),
    (r"\boxed{\frac{1}{2}}", "1/2", True),
    (r"\boxed{1.5}", "3/2", True),
    (r"\boxed{12}", "12.0", True),
    (r"\boxed{0.3333}", r"\frac13", False),
    (r"\boxed{1024.0001}", "1024", False),
    (r"\boxed{-3}", "3", False),
    (r"\boxed{1000}", "1,000", True),
    (r"\boxed{2^{10}}", "1024", True),
    (r"\boxed{10^{-3}}", "0.001", True),
    # radicals and symbolic forms
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", True),
    (r"The answer is $\frac{\sqrt{2}}{2}$", r"\frac{1}{\sqrt{2}}", True),
    (r"\boxed{x+1}", "1+x", True),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", True),
    (r"\boxed{\pi}", "3.14159", False),
    (r"\boxed{\infty}", r"\infty", True),
    # intervals, sets, multiple answers, equations, matrices
    (r"\boxed{(1, 2]}", "(1,2]", True),
    (r"\boxed{[1, 2]}", "(1,2]", False),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3)", True),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", True),
    (r"\boxed{1, 2}", "2, 1", True),
    (r"\boxed{1, 3}", "2, 1", False),
    (r"\boxed{a=1,b=2}", "a=1,b=2", True),
    (r"\boxed{x=3}", "3", True),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"\boxed{\begin{pmatrix}1\\3\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", False),
    # units, percentages, currency, degrees
    (r"\boxed{5\text{ cm}}", "5", True),
    (r"\boxed{5 \text{ meters}}", "5", True),
    (r"\boxed{50\%}", "0.5", True),
    (r"\boxed{\$5}", "5", True),
    (r"\boxed{90^\circ}", "90", True),
    # plain text and multiple choice
    (r"\boxed{\text{Paris}}", r"\text{Paris}", True),
    (r"\boxed{paris}", "Paris", True),
    (r"\boxed{Pairs}", "Paris", False),  # sympy alone would read both as the product p·a·r·i·s
    (r"\boxed{B}", "B", True),
    (r"\boxed{\text{(B)}}", "B", True),
    # GSM8K references, unboxed answers, adversarial near-misses
    (r"so the answer is \boxed{42}", "#### 42", True),
    ("12 apples, then 7", "7", True),
    ("7", "7", True),
    ("no number", "7", False),
    ("", "4", False),
    (r"\boxed{3}\boxed{4}", "4", False),  # two answers hedge: not paid
    (r"\boxed{43}", "#### 42", False),
]


@pytest.mark.slow
async def test_math_reward_pays_exactly_the_right_answers():
    """The table through the reward's worker pool, where the trainer runs it (math-verify's parsers,
    run in this interpreter, leave CPython 3.11.7's AST validator in a state that breaks later imports)."""
    pool = make_scorer("kuberl.rewards:math", workers=2, timeout=60.0)
    try:
        scores = await asyncio.gather(*(pool.score("", c, a, {}) for c, a, _ in MATH_TABLE))
    finally:
        await pool.aclose()
    wrong = [(c, a, paid) for (c, a, paid), got in zip(MATH_TABLE, scores, strict=True) if got != float(paid)]
    assert wrong == [] and pool.errors == pool.timeouts == 0


def test_the_table_is_large_and_both_ways():
    assert len(MATH_TABLE) >= 40
    assert sum(p for *_, p in MATH_TABLE) >= 15 and sum(not p for *_, p in MATH_TABLE) >= 15


def test_the_api_list_of_rewards_is_what_the_module_ships():
    shipped = {name for name in rewards.__all__ if callable(getattr(rewards, name)) and name not in
               ("call_reward", "load_reward")} - {"RewardFn"}
    assert set(KUBERL_REWARDS) == shipped
    assert reward_issue("kuberl.rewards:no_such_reward") is not None
    assert reward_issue("kuberl.rewards:math") is None and reward_issue("my.module:anything") is None
    assert reward_issue("kuberl.rewards.code:code") is None  # a module of KubeRL's rewards: imported at start-up
    for typo in ("kuberl.reward:math", "kuberl:math", "kuberl.sandbox:run_python"):  # KubeRL's, not its rewards
        assert "KubeRL's rewards live in kuberl.rewards" in reward_issue(typo), typo


def test_a_reward_gets_the_row_columns_it_names_or_all_with_kwargs():
    def named(prompt, completion, answer, tests):
        return float(tests == [1, 2])

    def catch_all(prompt, completion, answer, **row):
        return float(sorted(row) == ["extra_info", "tests"])

    def old_style(prompt, completion, answer):
        return 1.0

    row = {"tests": [1, 2], "extra_info": {"i": 3}, "prompt": "not passed twice"}
    assert call_reward(named, "p", "c", "a", row) == 1.0
    assert call_reward(catch_all, "p", "c", "a", row) == 1.0
    assert call_reward(old_style, "p", "c", "a", row) == 1.0
    assert call_reward(lambda p, c, a: c == a, "p", "x", "x", {}) == 1.0  # a bool is a verdict too
    with pytest.raises(ValueError, match="finite number"):
        call_reward(lambda p, c, a: float("nan"), "p", "c", "a", {})

    class Scorer:  # a callable object that defines equality is unhashable: its signature is read each call
        __eq__ = object.__eq__
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, prompt, completion, answer, tests):
            return float(tests == [1, 2])

    assert call_reward(Scorer(), "p", "c", "a", row) == 1.0
    assert call_reward(named, "p", "c", "a", row) == 1.0  # the second call reads the cached signature


@pytest.fixture
def user_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's reward module, importable by the workers (sys.path travels to them)."""
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent('''
        import asyncio, time

        def sometimes_hangs(prompt, completion, answer, **row):
            if row.get("hang"):
                time.sleep(3600)
            if row.get("boom"):
                raise RuntimeError("boom")
            print("a reward that prints")  # must not corrupt the replies
            return float(completion == answer)

        async def judged(prompt, completion, answer, weight=1.0):
            await asyncio.sleep(0.01)
            return weight * float(completion == answer)

        def sees_secrets(prompt, completion, answer):
            import os
            return float(any(name in os.environ for name in completion.split(",")))

        def writes_junk(prompt, completion, answer):
            import os
            if completion == "junk":
                for fd in range(3, 32):  # whichever is the replies' channel
                    try:
                        os.write(fd, b"not a reply\\n")
                    except OSError:
                        pass
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards"


@pytest.mark.slow
async def test_a_reward_that_hangs_on_one_prompt_in_20_costs_its_timeout_and_stalls_nothing(user_rewards: str):
    """One call in 20 sleeps forever, one raises: both score 0 and are counted; the other 18 are scored
    while the hung worker waits out its limit; the hung worker is replaced and the pool keeps scoring."""
    pool = RewardPool(f"{user_rewards}:sometimes_hangs", workers=2, timeout=1.0)
    try:
        await pool.score("warm", "1", "1", {})  # the workers' start-up is not part of the measure
        started = time.perf_counter()
        calls = [pool.score("p", "1", "1" if i % 3 else "2", {"hang": i == 5, "boom": i == 7}) for i in range(20)]
        scores = await asyncio.gather(*calls)
        elapsed = time.perf_counter() - started
        assert scores == [0.0 if i in (5, 7) or i % 3 == 0 else 1.0 for i in range(20)]
        assert (pool.timeouts, pool.errors) == (1, 1)
        assert elapsed < 1.0 + 5.0  # one timeout, not one per call; generous for a loaded CI host
        assert await asyncio.gather(*(pool.score("p", "x", "x", {}) for _ in range(6))) == [1.0] * 6
        assert pool.timeouts == 1
    finally:
        await pool.aclose()


@pytest.mark.slow
async def test_reward_workers_hold_none_of_kuberls_secrets_and_a_malformed_reply_is_an_error(
        user_rewards: str, monkeypatch: pytest.MonkeyPatch):
    """Issue 69, item 8: a reward (the user's code, scoring model-written text) gets the pod's
    environment without the API token, the agent token or the checkpoint-signing key; a worker whose
    replies' channel carries something else scores 0, is counted, and is replaced."""
    from kuberl.api.contract import KUBERL_SECRET_ENV

    for name in KUBERL_SECRET_ENV:
        monkeypatch.setenv(name, "secret-0123456789")
    monkeypatch.setenv("TEAM_SETTING", "kept")
    pool = RewardPool(f"{user_rewards}:sees_secrets", workers=1, timeout=30.0)
    try:
        assert await pool.score("p", ",".join(KUBERL_SECRET_ENV), "", {}) == 0.0
        assert await pool.score("p", "TEAM_SETTING", "", {}) == 1.0
    finally:
        await pool.aclose()
    pool = RewardPool(f"{user_rewards}:writes_junk", workers=1, timeout=30.0)
    try:
        assert await pool.score("p", "junk", "", {}) == 0.0 and pool.errors == 1
        assert await asyncio.gather(*(pool.score("p", "fine", "", {}) for _ in range(3))) == [1.0] * 3
        assert pool.errors == 1
    finally:
        await pool.aclose()


@pytest.mark.slow
async def test_async_rewards_and_row_columns_through_the_pool(user_rewards: str):
    pool = make_scorer(f"{user_rewards}:judged", workers=1, timeout=30.0)
    try:
        assert isinstance(pool, RewardPool)
        assert await pool.score("p", "7", "7", {"weight": 0.5, "other": [1]}) == 0.5
    finally:
        await pool.aclose()


def test_kuberls_string_rewards_run_in_place_and_a_missing_function_names_the_field():
    assert isinstance(make_scorer("kuberl.rewards:exact_match", 1, 1.0), InlineScorer)
    with pytest.raises(ValueError, match=r"spec\.evaluation\.reward\.function 'kuberl\.rewards:nope'"):
        make_scorer("kuberl.rewards:nope", 1, 1.0, "spec.evaluation.reward.function")





@pytest.mark.slow
async def test_the_code_reward_runs_the_program_against_the_rows_tests_in_the_sandbox():
    pool = make_scorer("kuberl.rewards:code", workers=2, timeout=60.0)
    right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    tests = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
    cases = [
        (right, "", tests, 1.0),
        ("```python\ndef add(a, b):\n    return a - b\n```", "", tests, 0.0),  # fails a test
        ("def add(a, b):\n    while True: pass", "", tests, 0.0),  # never ends: the sandbox's limit
        ("```python\nimport socket\nsocket.socket()\ndef add(a, b): return a + b\n```", "", tests, 0.0),  # no network
        (right, "assert add(2, 2) == 4", {}, 1.0),  # no tests column: the answer holds them
    ]
    try:
        scores = await asyncio.gather(*(pool.score("", c, a, row) for c, a, row, _ in cases))
    finally:
        await pool.aclose()
    assert scores == [want for *_, want in cases] and pool.errors == pool.timeouts == 0
