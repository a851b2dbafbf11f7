"""What the cluster has for a job: CPU headroom for Ray Data beside the workers, free
resources per node to keep tensor-parallel groups within a node, and the hardware the
workers get (for `auto` fields)."""

from __future__ import annotations

from typing import Callable

from raytrain_platform.config import JobConfig
from raytrain_platform.plan.auto import Hardware, cpu_hardware

__all__ = ["check_cpu_headroom", "cluster_hardware", "tp_label_selector"]


def check_cpu_headroom(cfg: JobConfig) -> None:
    """Training workers that take every CPU leave none for Ray Data's read tasks, and
    the run hangs waiting for its first batch: refuse that up front."""
    import ray

    from raytrain_platform.errors import ConfigError

    total = ray.cluster_resources().get("CPU", 0.0)
    # An elastic run starts with what there is, from min_workers up.
    lo = cfg.scaling.min_workers
    workers = lo if cfg.scaling.elastic and lo is not None else cfg.scaling.num_workers
    need = workers * cfg.scaling.cpus_per_worker
    if total and need > total - 0.5:
        raise ConfigError("scaling.cpus_per_worker", cfg.scaling.cpus_per_worker,
                          f"a value with {'min_workers' if cfg.scaling.elastic else 'num_workers'} "
                          f"({workers}) x cpus_per_worker "
                          f"<= {total - 0.5:g}: the cluster has {total:g} CPUs and Ray Data "
                          "needs at least 0.5 of them to feed the workers")


def tp_label_selector(cfg: JobConfig, per_worker: dict[str, float],
                       emit: Callable[[str], None]) -> list[dict[str, str]] | None:
    """Pin whole tensor-parallel groups to nodes (launch/placement.py) from the free
    resources of the cluster's alive nodes now, counting only the workers' own demand:
    what stays free on a node is Ray Data's and the Train controller's (0 CPUs).
    Elastic runs never get here with TP: config validation refuses elastic TP, and a
    pinned node that is lost would keep an elastic run from shrinking."""
    tp_size = cfg.parallel.tp_size
    if tp_size == 1:
        return None
    import ray
    from raytrain_platform.compat.ray_private import available_resources_per_node

    from raytrain_platform.launch.placement import describe_tp_placement, place_tp_groups

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    free = {node: res for node, res in available_resources_per_node().items() if node in alive}
    selectors = place_tp_groups(free, per_worker, num_workers=cfg.scaling.num_workers, tp_size=tp_size,
                                strategy=cfg.scaling.placement_strategy)
    if selectors:
        emit(describe_tp_placement(selectors, tp_size=tp_size))
    return selectors


def _gpu_memory() -> tuple[int, str]:
    import torch

    return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)


def cluster_hardware(cfg: JobConfig) -> Hardware:
    """What the job's workers will have on the connected Ray cluster: one GPU each
    (its memory measured by a task on a GPU node), or CPU memory per worker."""
    import ray

    from raytrain_platform.errors import ConfigError

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    n = cfg.scaling.num_workers
    if cfg.scaling.use_gpu:
        per_node = max(int(r.get("GPU", 0)) for r in nodes)
        if per_node == 0:
            raise ConfigError("scaling.use_gpu", True, "false on this cluster: it has no GPUs")
        mem, name = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_gpu_memory).remote())
        return Hardware.for_workers(n, per_node, device_memory=mem, headroom=0.1,
                                    source=f"{name}, {mem / 2**30:.1f} GiB")
    per_node = max(int(r.get("CPU", 0) // cfg.scaling.cpus_per_worker) for r in nodes)
    node_memory = max(int(r.get("memory", 0)) for r in nodes)
    return cpu_hardware(cfg, node_memory=node_memory, workers_per_node=per_node)
