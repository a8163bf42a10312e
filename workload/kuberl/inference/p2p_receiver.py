"""A replica's end of the p2p weight exchange (see :mod:`kuberl.weights.p2p` for the trainer's end).

``join`` gets this replica's part of the plan and opens the exchange group in a background thread
(it completes when every trainer rank has joined too). ``receive`` takes one version: the pieces
arrive in a staging copy of the parameters while generation goes on, then the engine takes them
(the torch engine copies them in between two engine steps; vLLM pauses and reloads) and sets the
version, so no request ever sees half an update.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..settings import Settings
from ..weights.transport import open_group, run_exchange, transfer_from_json
from .contract import Engine

log = logging.getLogger("kuberl.inference")


class NotJoined(RuntimeError):
    pass


class P2PReceiver:
    def __init__(self, engine: Engine, settings: Settings):
        """``settings``: where the exchange group's store listens (``exchange_address``: trainer rank 0,
        as the operator names it in this pod's environment) and this pod's IP."""
        self.engine, self.settings = engine, settings
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._group: Future[Any] | None = None
        self._rank = 0
        self._transfers: list[Any] = []
        self._staging: dict[str, torch.Tensor] = {}

    def join(self, body: dict[str, Any]) -> None:
        """``{"rank", "world", "transfers", "generation"}``; replaces any earlier group. The group's store is
        trainer rank 0 at the address this pod's settings name, never one a request names: a request
        cannot make a replica connect anywhere else."""
        self._rank = int(body["rank"])
        self._transfers = [transfer_from_json(row) for row in body["transfers"]]
        layout = self.engine.parameter_layout()
        unknown = sorted({t.dest for t in self._transfers} - layout.keys())
        if unknown:
            raise ValueError(f"the plan sends tensors this engine does not have: {unknown[:5]}")
        self._staging = {name: torch.empty(layout[name][0], dtype=layout[name][1])
                         for name in {t.dest for t in self._transfers}}
        store, port = self.settings.exchange_address
        self._executor.shutdown(wait=False)  # an earlier group may still wait for a member that is gone
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._group = self._executor.submit(open_group, store, port, self._rank, int(body["world"]),
                                            bind_host=self.settings.bind_host,
                                            generation=int(body.get("generation", 0)))
        log.info("joining the p2p exchange group as rank %d of %s (%d transfers)", self._rank, body["world"],
                 len(self._transfers))  # fmt: skip

    async def receive(self, version: int) -> float:
        if self._group is None:
            raise NotJoined("this replica has not joined a p2p exchange group (restarted?)")
        loop = asyncio.get_running_loop()
        group = await asyncio.wrap_future(self._group)
        stats = await loop.run_in_executor(self._executor, run_exchange, group, self._transfers, self._rank, {},
                                           self._staging)  # fmt: skip
        await self.engine.receive_parameters(self._staging, version)
        return stats.seconds
