"""An agent written against the OpenAI Python client, trained by KubeRL through its own API calls.

Nothing here knows about RL. The agent takes a task, talks to "the model" with chat completions
and a calculator tool, runs the tool itself, and says how well the episode went. KubeRL's gateway
(``spec.agent``) sits where the OpenAI API would be: ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
point the client at it. Two headers tie the calls of one episode together (a session) and the
episodes of one task together (a GRPO group); the reward ends the session.

    OPENAI_BASE_URL=http://<experiment>-gateway:8090/v1 OPENAI_API_KEY=<token> python calculator_agent.py

Runs until the gateway goes away (the run is over); ``--episodes N`` stops after N.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a+b, a-b or a*b on integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
ARITHMETIC = re.compile(r"^\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*$")


def calculator(expression: str) -> str:
    """The tool, run by the agent (not by the model server)."""
    match = ARITHMETIC.match(expression)
    if match is None:
        return "error: expected a+b, a-b or a*b"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def episode(client: openai.OpenAI, model: str, task: dict[str, str], max_turns: int = 3) -> float:
    """One episode: the model may call the calculator; its final answer is rewarded 1 if right."""
    session = client.with_options(default_headers={"X-KubeRL-Session": uuid.uuid4().hex,
                                                   "X-KubeRL-Group": task["group"]})
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    answer = ""
    for _ in range(max_turns):
        reply = session.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        call = message.tool_calls[0]
        expression = json.loads(call.function.arguments).get("expression", "")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(str(expression))})
    reward = float(answer.strip() == task["answer"])
    session_id = session.default_headers["X-KubeRL-Session"]
    client.post(f"/sessions/{session_id}/reward", body={"reward": reward}, cast_to=object)
    return reward


def work(client: openai.OpenAI, model: str, episodes: int | None) -> list[float]:
    """Episodes, one after the other, until ``episodes`` are done or the gateway is gone."""
    rewards: list[float] = []
    while episodes is None or len(rewards) < episodes:
        try:
            task = client.get("/tasks/next", cast_to=object)
            while True:
                try:
                    rewards.append(episode(client, model, task))
                    break
                except openai.RateLimitError:  # still 429 after the client's own retries: the trainer
                    time.sleep(0.5)            # is behind (the staleness bound); the same task again
        except openai.APIConnectionError:
            if episodes is not None:
                raise
            return rewards  # the trainer finished and took the gateway with it
    return rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16, help="episodes in flight")
    parser.add_argument("--episodes", type=int, default=None, help="per worker (default: until the run ends)")
    args = parser.parse_args(argv)
    client = openai.OpenAI(max_retries=10, timeout=120)  # a 429 says: wait for the trainer (Retry-After)
    for _ in range(300):  # the gateway opens once the trainer is up
        try:
            model = client.models.list().data[0].id
            break
        except openai.APIConnectionError:
            time.sleep(1)
    else:
        print("calculator_agent: the gateway at OPENAI_BASE_URL never answered", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(lambda _: work(client, model, args.episodes), range(args.workers)))
    rewards = [r for worker in results for r in worker]
    print(json.dumps({"episodes": len(rewards), "reward": sum(rewards) / max(1, len(rewards))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
