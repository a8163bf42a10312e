"""Client of the inference pool: load-balanced generate, pause/resume, weight pushes.

A request goes to the replica with the fewest requests in flight. If it comes back aborted (the
replica paused for a weight update), it is resubmitted to the *same* replica as prompt + the
tokens generated so far, with the remaining token budget; the pieces are concatenated, so each
token keeps the version that wrote it. A replica that cannot be reached is skipped for a while.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

log = logging.getLogger("kuberl.rollout")


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    down_until: float = 0.0


@dataclass
class InferenceClient:
    urls: list[str]
    timeout: float = 600.0
    replicas: list[Replica] = field(init=False)
    _session: aiohttp.ClientSession | None = field(default=None, init=False)
    _control: aiohttp.ClientSession | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("no inference replicas configured")
        self.replicas = [Replica(u.rstrip("/")) for u in self.urls]

    async def __aenter__(self) -> InferenceClient:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self._control = aiohttp.ClientSession(timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for session in (self._session, self._control):
            if session:
                await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use `async with InferenceClient(...)`")
        return self._session

    def _pick(self) -> Replica:
        now = time.monotonic()
        alive = [r for r in self.replicas if r.down_until <= now] or self.replicas
        return min(alive, key=lambda r: r.in_flight)

    async def _post(self, replica: Replica, path: str, control: bool = False, **kwargs: Any) -> dict[str, Any]:
        session = self._control if control else self._session
        if session is None:
            raise RuntimeError("use `async with InferenceClient(...)`")
        async with session.post(replica.url + path, **kwargs) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{replica.url}{path}: HTTP {resp.status}: {await resp.text()}")
            return await resp.json()

    async def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            while True:
                try:
                    async with self.session.get(replica.url + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"inference replica {replica.url} not healthy after {timeout:.0f}s")
                await asyncio.sleep(0.2)

    async def generate(self, input_ids: list[int], n: int, max_new_tokens: int, temperature: float,
                       top_p: float) -> list[dict[str, Any]]:
        """``n`` completions of ``input_ids``; aborted ones are resumed until they finish."""
        while True:
            replica = self._pick()
            replica.in_flight += n
            try:
                body = {"input_ids": input_ids, "n": n, "max_new_tokens": max_new_tokens,
                        "temperature": temperature, "top_p": top_p}
                outputs = (await self._post(replica, "/generate", json=body))["outputs"]
                return list(await asyncio.gather(*(
                    self._complete(replica, input_ids, o, max_new_tokens, temperature, top_p) for o in outputs)))
            except (TimeoutError, aiohttp.ClientConnectionError) as err:
                replica.down_until = time.monotonic() + 2.0
                log.warning("replica %s unreachable (%s); retrying elsewhere", replica.url, err)
                await asyncio.sleep(0.2)
            finally:
                replica.in_flight -= n

    async def _complete(self, replica: Replica, input_ids: list[int], out: dict[str, Any], budget: int,
                        temperature: float, top_p: float) -> dict[str, Any]:
        while out["finish_reason"] == "abort" and len(out["output_ids"]) < budget:
            body = {"input_ids": input_ids + out["output_ids"], "n": 1,
                    "max_new_tokens": budget - len(out["output_ids"]), "temperature": temperature, "top_p": top_p}
            more = (await self._post(replica, "/generate", json=body))["outputs"][0]
            out = {k: out[k] + more[k] for k in ("output_ids", "logprobs", "versions")} | {
                "finish_reason": more["finish_reason"], "resumed": out.get("resumed", 0) + 1}
        if out["finish_reason"] == "abort":
            out["finish_reason"] = "length"
        return out

    async def pause_all(self) -> None:
        await asyncio.gather(*(self._post(r, "/pause", control=True) for r in self.replicas))

    async def resume_all(self) -> None:
        await asyncio.gather(*(self._post(r, "/resume", control=True) for r in self.replicas))

    async def push_weights(self, blob: bytes, version: int) -> None:
        """Naive broadcast: the full state to every replica; each swaps it in between two engine steps."""
        await asyncio.gather(*(self._post(r, f"/update_weights?version={version}", control=True, data=blob)
                               for r in self.replicas))
