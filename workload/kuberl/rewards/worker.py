"""A reward worker process: ``python -m kuberl.rewards.worker MODULE:FUNCTION SYS_PATH_JSON``.

Line-delimited JSON on its stdin and stdout (:mod:`.pool` is the other end). It answers
``{"ready": true}`` once the function is imported (``{"error": …}`` and exit 1 if it cannot be),
then for each request ``{"prompt", "completion", "answer", "row"}`` one reply, ``{"reward": x}`` or
``{"error": "Type: message"}``. Whatever the reward function prints goes to stderr (the trainer's
log), never into the replies. It exits when its stdin closes (the trainer is gone).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO


def _private_stdout() -> TextIO:
    """The replies' channel: a copy of fd 1, after which fd 1 (and ``print``) goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(function: str, replies: TextIO) -> int:
    from . import call_reward, load_reward

    try:
        fn = load_reward(function)
    except Exception as err:  # any import-time failure of the user's module
        _reply(replies, {"error": f"{type(err).__name__}: {err}"})
        return 1
    _reply(replies, {"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = call_reward(fn, request["prompt"], request["completion"], request["answer"], request["row"])
        except Exception as err:  # the reward's own failure: reported, scored 0 by the pool
            _reply(replies, {"error": f"{type(err).__name__}: {err}"[:500]})
            continue
        _reply(replies, {"reward": value})
    return 0


def main(argv: list[str]) -> int:
    function, sys_path = argv[1], json.loads(argv[2])
    sys.path[:] = [p for p in sys_path if isinstance(p, str)]
    return serve(function, _private_stdout())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
