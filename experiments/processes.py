"""Several processes of one run (``jax.distributed``): joining them with a timeout,
connecting their CPU collectives up front, and the barriers where they wait for each other."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["DISTRIBUTED_TIMEOUT_S", "initialize_distributed", "checked_timeout",
           "connect_collectives", "sync"]

# How long a process of a multi-process run waits for the others (to start and connect, to
# reach a barrier) before it fails: ``--distributed-timeout``, initialize_distributed().
DISTRIBUTED_TIMEOUT_S = 300
_distributed = {"timeout_s": DISTRIBUTED_TIMEOUT_S, "connected": False, "barriers": 0}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *,
                           timeout_s: float = DISTRIBUTED_TIMEOUT_S):
    """Join the processes of a multi-process run (``jax.distributed.initialize``; the
    arguments not given are auto-detected by JAX) before JAX touches a device, then connect
    their CPU collectives (:func:`connect_collectives`).

    ``timeout_s`` bounds every wait for a peer that this module controls: the connection
    (``initialization_timeout``: a process that starts late), the exchange of the devices'
    topology when the backend starts, and the barriers of :func:`train` (a peer still
    loading, restoring or compiling). Waits inside a collective are XLA's own (30 minutes
    on CPU, ``--xla_cpu_collective_timeout_seconds``), except gloo's connection of a new
    group of devices (and its reduce-scatter, which no program of a run has), fixed at 30 s
    in this jaxlib (gloo's default context timeout, which XLA does not set): hence the
    connection of the run's groups up front, with every process at the same point."""
    timeout_s = checked_timeout(timeout_s)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id,
                               initialization_timeout=max(1, math.ceil(timeout_s)))
    # the CPU backend's topology exchange when it starts (next): JAX's defaults are 2 and 5
    # minutes, the global one must be the longer
    minutes = max(1, math.ceil(timeout_s / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", max(2, minutes))
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", max(5, minutes + 1))
    _distributed["timeout_s"] = timeout_s
    connect_collectives()


def checked_timeout(timeout_s) -> float:
    """``timeout_s`` as float seconds; ValueError unless positive and finite."""
    t = float(timeout_s)
    if not 0 < t < math.inf:
        raise ValueError(f"the distributed timeout must be a positive number of seconds, "
                         f"not {t:g}")
    return t


def _client():
    """The coordination service's client of ``jax.distributed`` (None without it)."""
    from jax._src import distributed

    return distributed.global_state.client


def _barrier(name: str):
    """Every process waits here for the others, through the coordination service (not a
    collective): up to the distributed timeout, then an error naming the barrier."""
    _distributed["barriers"] += 1  # every process passes the same barriers in the same order
    key = f"experiments.train:{name}:{_distributed['barriers']}"
    _client().wait_at_barrier(key, max(1, int(_distributed["timeout_s"] * 1000)))


def connect_collectives():
    """Connect the CPU collectives of the groups of devices a multi-process run uses, every
    process at the same point (once per process; one process or another platform: no-op).

    XLA connects gloo's TCP mesh of a group of devices on the first collective that uses it,
    and gloo gives every peer 30 s to arrive (``DEADLINE_EXCEEDED: GetKeyValue() timed
    out``), a limit no option of this jaxlib changes. A peer that reaches its first step
    later than that (compiling on a loaded machine, restoring, process 0 writing the files)
    made the others fail. So each group is connected here by a tiny psum, compiled first and
    run after a barrier (:func:`_barrier`, the distributed timeout), which every process
    leaves together: later collectives on a connected group wait for a late peer as long as
    XLA's collective timeout. The groups: all devices in ``jax.devices()`` order (the run's
    ``data`` mesh, :class:`Placement`: its steps' and evaluations' all-reduces), and each
    local device's index across the processes (``multihost_utils``' mesh
    ``[processes, local devices]``, which its process_allgather and orbax's barriers use)."""
    if (_distributed["connected"] or jax.process_count() == 1
            or jax.default_backend() != "cpu" or _client() is None):
        return
    devices = np.array(jax.devices())
    programs = []
    for mesh, axis in ((Mesh(devices, ("data",)), "data"),
                       (Mesh(devices.reshape(jax.process_count(), jax.local_device_count()),
                             ("processes", "local")), "processes")):
        spec = P(*mesh.axis_names)
        ones = np.ones(mesh.devices.shape, np.int32)
        x = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, spec),
                                         lambda index, ones=ones: ones[index])
        psum = jax.shard_map(lambda v, axis=axis: jax.lax.psum(v, axis), mesh=mesh, in_specs=spec,
                             out_specs=spec)
        programs.append((jax.jit(psum).lower(x).compile(), x, mesh.shape[axis]))
    _barrier("connect")
    for program, x, size in programs:
        if not all((np.asarray(s.data) == size).all() for s in program(x).addressable_shards):
            raise RuntimeError(f"connecting the CPU collectives: a psum of ones over {size} "
                               "devices did not give the device count")
    _distributed["connected"] = True


def sync(name: str):
    """The processes of a multi-process run wait here for each other (one: no-op)."""
    if jax.process_count() == 1:
        return
    if _client() is None:  # a cluster without jax.distributed's service
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"experiments.train:{name}")
    else:
        _barrier(name)
