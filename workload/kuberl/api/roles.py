"""Each role's process, described once: the environment that says who a process is and the gang
restart rule. The operator's builders write it into pods; ``kuberl run`` gives the same to its local
processes — only hosts and ports differ (``kuberl.local.LOCAL_MAPPINGS`` lists them), and a local
trainer rank gets directly what torchrun gives each process in a pod (``torchrun_process_env``).
"""

from __future__ import annotations

from .contract import (
    ENV_EXCHANGE_ADDR,
    ENV_EXCHANGE_PORT,
    ENV_INFERENCE_SERVICE,
    ENV_PORT,
    ENV_REPLICA,
    ENV_REPLICA_HOST,
    ENV_REPLICA_HOSTS,
    ENV_REPLICA_LEADER,
    ENV_ROLE,
    ROLE_INFERENCE,
    ROLE_TRAINER,
)


def inference_env(replica: int, port: int, exchange: tuple[str, int] | None,
                  hosts: tuple[int, int, str] | None = None) -> dict[str, str]:
    """An inference replica's process: its index, its HTTP port and, for the p2p weight exchange, the
    store of trainer rank 0 it joins (``exchange``: host, port; None: no exchange address to give);
    for a replica over several hosts, ``hosts``: this process's rank in it, their count, and the
    leader's host:port where they meet."""
    env = {ENV_ROLE: ROLE_INFERENCE, ENV_REPLICA: str(replica), ENV_PORT: str(port)}
    if exchange is not None:
        env |= {ENV_EXCHANGE_ADDR: exchange[0], ENV_EXCHANGE_PORT: str(exchange[1])}
    if hosts is not None:
        env |= {ENV_REPLICA_HOST: str(hosts[0]), ENV_REPLICA_HOSTS: str(hosts[1]), ENV_REPLICA_LEADER: hosts[2]}
    return env


def trainer_node_env(master: tuple[str, int], nodes: int, procs_per_node: int, node_rank: int,
                     inference_service: str | None) -> dict[str, str]:
    """A trainer node's torchrun: the rendezvous at rank 0 (``master``: host, port), the gang's shape,
    this node's rank and the pool's headless Service (None: replica URLs come from elsewhere)."""
    env = {ENV_ROLE: ROLE_TRAINER, "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
           "WORLD_SIZE": str(nodes * procs_per_node), "NNODES": str(nodes), "NODE_RANK": str(node_rank),
           "NPROC_PER_NODE": str(procs_per_node)}
    if inference_service:
        env[ENV_INFERENCE_SERVICE] = inference_service
    return env


def torchrun_process_env(node_env: dict[str, str], local_rank: int) -> dict[str, str]:
    """What torchrun adds for the process of ``local_rank`` on that node: its global ``RANK``
    (node rank × processes per node + local rank) and ``LOCAL_RANK``."""
    rank = int(node_env["NODE_RANK"]) * int(node_env["NPROC_PER_NODE"]) + local_rank
    return {**node_env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}


def gang_may_restart(restarts: int, backoff_limit: int) -> bool:
    """A trainer rank failed at run time: the whole gang restarts from its last checkpoint while it has
    restarted fewer than ``backoff_limit`` times (``spec.trainer.backoffLimit``); then the run fails."""
    return restarts < backoff_limit
