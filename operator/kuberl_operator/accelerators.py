"""What each accelerator kind means for a pod: extended resource, default image, env, labels."""

from __future__ import annotations

from dataclasses import dataclass, field

from kuberl.api import EXTENDED_RESOURCE, Accelerator

from .settings import DEFAULT_BUILD, BuildSettings


@dataclass(frozen=True)
class AcceleratorProfile:
    kind: Accelerator
    resource: str | None  # extended resource name, None for cpu
    image: str
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # on pods and PodGroups: what the Ascend stack expects
    shm_size: str = "1Gi"
    # Defaults when a manifest sets none: the container's memory limit and the /tmp scratch volume's
    # size (model cache, checkpoint staging); resources.limits memory / ephemeral-storage override them.
    memory_limit: str = "8Gi"
    scratch_size: str = "20Gi"
    # The requests a pod makes per device when its manifest sets none: a share of the node shapes this
    # accelerator comes in, so quota, bin-packing and eviction order see the pod's real size.
    cpu_per_device: str = "0"
    memory_per_device: str = "0"
    field_env: dict[str, str] = field(default_factory=dict)  # env from the downward API: name → fieldPath
    supplemental_groups: tuple[int, ...] = ()  # groups that own the device files, for a non-root process


def profile(kind: Accelerator | str, engine: str | None = None, settings: BuildSettings = DEFAULT_BUILD,
            ) -> AcceleratorProfile:
    """``engine``: the inference pool's engine (None for trainer pods); ``settings``: the operator's
    images and Ascend driver details."""
    kind = Accelerator(kind)
    image = settings.images.image(kind, engine)
    if kind == Accelerator.NVIDIA:
        return AcceleratorProfile(
            kind, EXTENDED_RESOURCE[kind], image,
            env={"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
            shm_size="16Gi", memory_limit="256Gi", scratch_size="500Gi",
            # 8-GPU nodes (H100/H200 HGX: 192-224 CPUs, 2 TiB): 96 CPUs and 768 GiB for 8 devices, the
            # rest for the system and daemonsets
            cpu_per_device="12", memory_per_device="96Gi",
        )
    if kind == Accelerator.ASCEND:
        return AcceleratorProfile(
            kind, EXTENDED_RESOURCE[kind], image,
            env={
                "HCCL_CONNECT_TIMEOUT": "1200",
                "HCCL_EXEC_TIMEOUT": "1200",
                "ASCEND_GLOBAL_LOG_LEVEL": "3",
                "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
            },
            # HCCL's host-side sockets bind the pod's own address, not whatever interface comes first.
            field_env={"HCCL_IF_IP": "status.podIP"},
            # MindCluster (Ascend Device Plugin, Ascend Operator, Volcano) selects pods and PodGroups
            # by this label: ascend-910 (Atlas training series) or ascend-<chip>b (Atlas A2/A3).
            labels={"ring-controller.atlas": settings.ascend_ring_controller},
            # /dev/davinci* belong to the driver's HwHiAiUser group (its gid is chosen at driver
            # install; 1000 by default): a non-root process needs it as a supplemental group.
            supplemental_groups=(settings.ascend_device_gid,),
            shm_size="16Gi", memory_limit="256Gi", scratch_size="500Gi",
            # Atlas 800T A2 (8 NPUs, 192 Kunpeng cores, 1 TiB or more): 160 cores and 768 GiB for 8 devices
            cpu_per_device="20", memory_per_device="96Gi",
        )
    return AcceleratorProfile(kind, None, image, env={"OMP_NUM_THREADS": "1"})
