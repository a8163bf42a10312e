"""Trainer rank 0's rollout, in a process of its own (``python -m kuberl.trainer.rollout_process``).

Why a process: the rollout's Python — episodes, HTTP replies, rewards, the gateway — took ≈ 7.4 ms of
CPU a step (the main example) on a thread of the trainer's process, holding the trainer's GIL and
preempting its thread on its core; the asynchronous step stayed ≈ 1.11 × the slower of generation and
training. Here it has an interpreter of its own, on the cores it is given (``settings.rolloutCores``:
``kuberl run`` gives it the replicas'; elsewhere it shares the pod's).

:meth:`RolloutProcess.launch` starts the process at the beginning of set-up, so that its imports
overlap the model's loading; :meth:`RolloutProcess.build` then hands it a
:class:`~.rollout_side.RolloutRecipe` and waits until it serves (its replicas answer). Every other
method is one call of :class:`~.rollout_side.RolloutSide`'s through :mod:`kuberl.ipc`. The process
ends when the trainer stops it or when the trainer's end of the connection closes (the trainer
exited, however it did).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..ipc import Caller, PeerGone, connection_pair, serve

if TYPE_CHECKING:
    from ..api.progress import PoolReceipt
    from ..rollout.evaluation import EvalResult
    from ..rollout.types import Group
    from .rollout_side import RolloutRecipe, RolloutSnapshot

log = logging.getLogger("kuberl.trainer")
STOP_SECONDS = 60.0  # for the rollout to stop (its gateway, reward workers and loop), then it is killed


class RolloutProcess:
    """The trainer's handle on its rollout process (what ``kuberl.weights`` calls its ``ReplicaControl``)."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection):
        self.process = process
        self._caller = Caller(conn, "rollout", process.poll)

    @classmethod
    def launch(cls, cores: tuple[int, ...] = ()) -> RolloutProcess:
        """Start the process (on ``cores``; (): wherever this one may run); it waits for :meth:`build`."""
        mine, theirs = connection_pair()
        args = [sys.executable, "-m", "kuberl.trainer.rollout_process", "--fd", str(theirs.fileno())]
        if cores:
            args += ["--cores", ",".join(map(str, cores))]
        try:
            process = subprocess.Popen(args, pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        log.info("rollout process %d started%s", process.pid, f" on cores {list(cores)}" if cores else "")
        return cls(process, mine)

    def _wait(self, method: str, *args: Any) -> Any:
        return self._caller.call(method, *args).result()

    def build(self, recipe: RolloutRecipe) -> None:
        """Build the rollout from ``recipe`` and wait until it serves; raises what building raised."""
        self._wait("build", recipe)

    def take(self, groups: int, version: int, ahead: bool = False) -> list[Group] | None:
        """:meth:`kuberl.rollout.controller.RolloutController.take`."""
        return self._wait("take", groups, version, ahead)

    def snapshot(self) -> RolloutSnapshot:
        return self._wait("snapshot")

    def data_state(self) -> tuple[int, dict[str, Any] | None]:
        return self._wait("data_state")

    def dataset(self) -> dict[str, Any]:
        return self._wait("dataset")

    def update_weights(self, payload: bytes | str, version: int) -> Future[PoolReceipt]:
        return self._caller.call("update_weights", payload, version)

    def receive_p2p(self, version: int, relayed: bool = False) -> Future[PoolReceipt]:
        return self._caller.call("receive_p2p", version, relayed)

    def join_p2p(self, bodies: list[dict[str, Any]]) -> None:
        self._wait("join_p2p", bodies)

    def replica_topologies(self) -> list[dict[str, str]]:
        return self._wait("replica_topologies")

    def p2p_membership_changed(self) -> bool:
        return self._wait("p2p_membership_changed")

    def start_evaluation(self, step: int) -> Future[EvalResult]:
        return self._caller.call("start_evaluation", step)

    def stop(self) -> None:
        """Stop the rollout (gateway, reward workers, loop) and wait for the process to exit (killed
        after :data:`STOP_SECONDS`)."""
        try:
            self._caller.call("stop").result(STOP_SECONDS)
        except PeerGone as err:  # the run's work is saved by now: a rollout gone at the end fails nothing
            log.warning("%s before it was stopped", err)
        finally:
            self._caller.close()
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("rollout process %d did not exit; killing it", self.process.pid)
                self.process.kill()
                self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kuberl.trainer.rollout_process")
    parser.add_argument("--fd", type=int, required=True, help="this end of the trainer's connection")
    parser.add_argument("--cores", default="", help="the CPU cores to run on (comma-separated; none: any)")
    args = parser.parse_args()
    if args.cores:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(message)s")
    from ..interpreter import hand_over_the_gil_often
    from .rollout_side import INLINE, RolloutHost

    hand_over_the_gil_often()  # no torch here (routes of a mixture of experts import it, to decode them)
    serve(Connection(args.fd), RolloutHost(), inline=INLINE)
    logging.shutdown()  # the trainer closed its end: whatever still runs (a blocked take) ends with the process
    os._exit(0)


if __name__ == "__main__":
    main()
