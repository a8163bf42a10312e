"""examples/agents/calculator_agent.py, plus a second client — a process of its own at the lowest CPU
priority (a client on another machine: its own CPU is not the run's), from another address
(``--source``, e.g. 127.0.0.2: its own client to the gateway's per-client budget) — that floods the
gateway for ``--duration`` seconds, ``--after`` seconds after the gateway first answers. ``--mode``:

- ``refused``: each call a new session whose first call is refused (``n: 2``) — the retry loop of a
  buggy agent;
- ``abandoned``: each call a new session with one valid turn, never rewarded.

The flood's start and end (wall clock) go to ``--log`` as JSON. Used by ``benchmarks/gateway_flood.py``."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_tools import load_example


def flood(args: argparse.Namespace, stop_at: float, counts: dict[int, int], lock: threading.Lock) -> None:
    base, token = os.environ["OPENAI_BASE_URL"].rstrip("/"), os.environ["OPENAI_API_KEY"]
    transport = httpx.HTTPTransport(local_address=args.source)
    with httpx.Client(transport=transport, timeout=30, headers={"Authorization": f"Bearer {token}"}) as client:
        while time.time() < stop_at:
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "12*34="}]}
            if args.mode == "refused":
                body["n"] = 2
            headers = {"X-KubeRL-Session": uuid.uuid4().hex, "X-KubeRL-Group": uuid.uuid4().hex}
            try:
                status = client.post(f"{base}/chat/completions", json=body, headers=headers).status_code
            except httpx.HTTPError:
                status = 0
            with lock:
                counts[status] = counts.get(status, 0) + 1


def flooder(args: argparse.Namespace) -> None:
    os.nice(19)
    base, token = os.environ["OPENAI_BASE_URL"].rstrip("/"), os.environ["OPENAI_API_KEY"]
    while True:  # the gateway opens once the trainer is up
        try:
            if httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    time.sleep(args.after)
    start = time.time()
    counts: dict[int, int] = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=flood, args=(args, start + args.duration, counts, lock))
               for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    Path(args.log).write_text(json.dumps({"start": start, "end": time.time(), "statuses": counts}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["refused", "abandoned"], required=True)
    parser.add_argument("--source", default="127.0.0.2")
    parser.add_argument("--after", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--log", required=True)
    args, rest = parser.parse_known_args()
    process = multiprocessing.get_context("spawn").Process(target=flooder, args=(args,), daemon=True)
    process.start()
    return load_example().main(rest)


if __name__ == "__main__":
    sys.exit(main())
