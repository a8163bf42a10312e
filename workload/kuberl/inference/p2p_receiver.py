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
from ..weights.plan import Box, Transfer
from ..weights.transport import forwards_from_json, open_group, run_staged, transfer_from_json
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
        self._stages: list[list[Transfer]] = []
        self._forwards: list[tuple[str, str, Box]] = []  # what this replica relays in a later stage
        self._staging: dict[str, torch.Tensor] = {}

    def join(self, body: dict[str, Any]) -> None:
        """``{"rank", "world", "stages", "forwards", "generation"}`` (``stages``: this replica's transfers
        in each stage of the plan; ``forwards``: what it relays in the later stages, from what it
        received; an older trainer's ``transfers`` is one stage); replaces any earlier group. The group's
        store is trainer rank 0 at the address this pod's settings name, never one a request names: a
        request cannot make a replica connect anywhere else."""
        self._rank = int(body["rank"])
        stages = body["stages"] if "stages" in body else [body["transfers"]]
        self._stages = [[transfer_from_json(row) for row in stage] for stage in stages]
        self._forwards = forwards_from_json(body.get("forwards", []))
        layout = self.engine.parameter_layout()
        received = {t.dest for stage in self._stages for t in stage if t.dst == self._rank}
        unknown = sorted((received | {dest for _, dest, _ in self._forwards}) - layout.keys())
        if unknown:
            raise ValueError(f"the plan sends tensors this engine does not have: {unknown[:5]}")
        self._staging = {name: torch.empty(layout[name][0], dtype=layout[name][1]) for name in received}
        store, port = self.settings.exchange_address
        self._executor.shutdown(wait=False)  # an earlier group may still wait for a member that is gone
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kuberl-p2p")
        self._group = self._executor.submit(open_group, store, port, self._rank, int(body["world"]),
                                            bind_host=self.settings.bind_host,
                                            generation=int(body.get("generation", 0)))
        log.info("joining the p2p exchange group as rank %d of %s (%d transfers, %d forwarded)", self._rank,
                 body["world"], sum(len(stage) for stage in self._stages), len(self._forwards))  # fmt: skip

    async def receive(self, version: int) -> float:
        if self._group is None:
            raise NotJoined("this replica has not joined a p2p exchange group (restarted?)")
        loop = asyncio.get_running_loop()
        group = await asyncio.wrap_future(self._group)
        stats = await loop.run_in_executor(self._executor, run_staged, group, self._stages, self._rank, {},
                                           self._staging, self._forwards)  # fmt: skip
        await self.engine.receive_parameters(self._staging, version)
        return stats.seconds
