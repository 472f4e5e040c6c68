"""The machine a strategy is planned for: devices and the links between them.

A `MachineModel` is a homogeneous cluster: `num_nodes` nodes of
`devices_per_node` devices each. Inside a node, devices talk over NVLink
(a dedicated link per ordered pair of devices), NVSwitch or PCIe (one
egress and one ingress port per device); between nodes over NICs (one
egress and one ingress port per NIC, `nics_per_node` NICs per node, device
`k` of a node using NIC `k % nics_per_node`). Every link is a serial
resource in the simulator; a transfer holds every link on its route.

Built from the attached TensorFlow devices (`load_machine(None)`), a
preset (`load_machine("p100x16")`) or a JSON spec file (schema in
`docs/MACHINE.md`). Imports no TensorFlow except for the live devices.
"""

import dataclasses
import json
import os
from typing import Any

import numpy as np

GIB = 1024**3
_GB = 1e9  # bandwidths are in GB/s, i.e. 1e9 bytes per second
POINT_TO_POINT = ("nvlink", "host")
PORTED = ("nvswitch", "pcie")
INTRA_KINDS = POINT_TO_POINT + PORTED


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One compute device.

    Args:
        kind: Device model, e.g. `P100`, `CPU`; keys the measured-cost cache.
        node: Index of the node (host) it sits in.
        peak_flops: Peak FLOP/s at the compute dtype (float32).
        memory_bytes: Memory capacity in bytes.
        memory_gbps: Memory bandwidth in GB/s (1e9 bytes per second).
        launch_overhead_ms: Fixed cost of one kernel launch, in ms.
    """

    kind: str
    node: int
    peak_flops: float
    memory_bytes: int
    memory_gbps: float
    launch_overhead_ms: float = 0.005


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One directed link, a serial resource.

    Args:
        name: Readable name, e.g. `nvlink 0->1`, `nic 2.0 out`.
        kind: `nvlink`, `nvswitch`, `pcie`, `host` or `nic`.
        bandwidth_gbps: Bandwidth in GB/s (1e9 bytes per second).
        latency_ms: Per-message latency in ms.
    """

    name: str
    kind: str
    bandwidth_gbps: float
    latency_ms: float


@dataclasses.dataclass(frozen=True)
class Route:
    """The links a transfer from one device to another holds.

    Transfers are cut-through: they hold every link at once, run at the
    slowest link's bandwidth and pay the sum of the latencies.

    Args:
        links: Link indices into `MachineModel.links`.
        bandwidth_gbps: Bottleneck bandwidth in GB/s.
        latency_ms: Sum of latencies in ms.
    """

    links: tuple[int, ...]
    bandwidth_gbps: float
    latency_ms: float

    def transfer_ms(self, num_bytes: float) -> float:
        """Time to move `num_bytes` over this route, in ms."""
        return self.latency_ms + num_bytes / (self.bandwidth_gbps * 1e6)


@dataclasses.dataclass(frozen=True)
class LinkGroup:
    """Links of one kind: intra-node fabric or inter-node NICs.

    Args:
        kind: See `LinkSpec.kind`.
        bandwidth_gbps: Per link (per direction), GB/s.
        latency_ms: Per message, ms.
    """

    kind: str
    bandwidth_gbps: float
    latency_ms: float


class MachineModel:
    """Devices and directed links of a homogeneous cluster.

    Args:
        name: Preset or file name.
        device: Spec shared by every device (its `node` is ignored).
        num_nodes: Number of nodes.
        devices_per_node: Devices in each node.
        intra: The intra-node fabric.
        inter: The inter-node NICs; None for a single node.
        nics_per_node: NICs per node (`h100x64` has one per GPU).
        live: True for the attached TensorFlow devices (measured costs).
        compute_groups: How many devices compute at once: devices
            `d` and `d + k * compute_groups` share one serial compute
            resource (virtual CPU devices share the host's cores). None:
            every device computes on its own.
        step_overhead_ms: Fixed cost of one training step beyond its
            tasks (launching the step, moving the batch in).
        allreduce: (latency ms, GB/s) of a measured all-reduce, by the
            bytes reduced; None: a ring over the links.
        allgather: (latency ms, GB/s) of a measured all-gather, by the
            bytes of one device's part (what a DTensor relayout on one
            mesh runs); None: a ring over the links.
        call_overhead_ms: Cost of calling one compiled function on the
            devices (a strategy over several meshes makes more calls).
        copy: (latency ms, GB/s) per piece of a region copied from one
            mesh to another inside a node, where that is not a link
            transfer of the same speed (virtual CPU devices: a memcpy,
            not the DTensor all-gather the links are fitted to;
            `calibration.py`); None: the links price it.
    """

    def __init__(
        self,
        name: str,
        device: DeviceSpec,
        num_nodes: int,
        devices_per_node: int,
        intra: LinkGroup,
        inter: LinkGroup | None = None,
        nics_per_node: int = 1,
        live: bool = False,
        compute_groups: int | None = None,
        step_overhead_ms: float = 0.0,
        allreduce: tuple[float, float] | None = None,
        allgather: tuple[float, float] | None = None,
        call_overhead_ms: float = 0.0,
        copy: tuple[float, float] | None = None,
    ):
        _check_shape(num_nodes, devices_per_node, nics_per_node)
        if compute_groups is not None and compute_groups < 1:
            raise ValueError(
                "`compute_groups` must be None or >= 1. Received: "
                f"compute_groups={compute_groups!r}"
            )
        if intra.kind not in INTRA_KINDS:
            raise ValueError(
                f"Intra-node links must be one of {INTRA_KINDS}. "
                f"Received: kind={intra.kind!r}"
            )
        if num_nodes > 1 and inter is None:
            raise ValueError(
                "A machine of several nodes needs `inter_node` links. "
                f"Received: num_nodes={num_nodes}, inter_node=None"
            )
        self.name = name
        self.num_nodes = num_nodes
        self.devices_per_node = devices_per_node
        self.nics_per_node = min(nics_per_node, devices_per_node)
        self.live = live
        self.compute_groups = compute_groups
        self.step_overhead_ms = float(step_overhead_ms)
        self.allreduce = allreduce
        self.allgather = allgather
        self.call_overhead_ms = float(call_overhead_ms)
        self.copy = copy
        self.intra, self.inter = intra, inter
        self.devices = tuple(
            dataclasses.replace(device, node=i // devices_per_node)
            for i in range(num_nodes * devices_per_node)
        )
        self.links: tuple[LinkSpec, ...] = ()
        self._routes = self._build_routes()
        self._copy_routes = self._routes if copy is None else [
            [self._copy_of(s, d, r) for d, r in enumerate(row)]
            for s, row in enumerate(self._routes)
        ]
        # Per (src, dst): the scheduler resources a transfer holds. Made
        # once: a search of NMT on k80x64 asked for them ~900,000 times.
        self._route_resources = [
            [() if r is None else self.link_resources(r.links) for r in row]
            for row in self._routes
        ]
        self._copy_figures = _route_figures(self._copy_routes)
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        # Why: simulators and cost caches hold on to a machine; a machine
        # changed under them would silently mix two clusters.
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"MachineModel is read-only. Received: {name}={value!r}. "
                "Build a new machine (e.g. from a JSON spec) instead."
            )
        object.__setattr__(self, name, value)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return (
            f"MachineModel(name={self.name!r}, num_nodes={self.num_nodes}, "
            f"devices_per_node={self.devices_per_node}, "
            f"kind={self.devices[0].kind!r}, intra={self.intra.kind!r}, "
            f"num_links={len(self.links)})"
        )

    def compute_resource(self, device: int) -> int:
        """The serial compute resource `device` runs its tasks on."""
        if self.compute_groups is None:
            return device
        return device % self.compute_groups

    def route(self, src: int, dst: int) -> Route:
        """The route from device `src` to device `dst` (src != dst)."""
        return self._routes[src][dst]

    def copy_route(self, src: int, dst: int) -> Route:
        """The route of a region copied between two meshes (src != dst):
        `route`'s links at the `copy` figures inside a node, `route`
        itself where there are none or the copy leaves the node."""
        return self._copy_routes[src][dst]

    @property
    def copy_route_figures(self) -> tuple[np.ndarray, np.ndarray]:
        """(latency ms, bandwidth GB/s) of every `copy_route`, as two
        read-only (devices, devices) arrays (NaN on the diagonal): an
        edge piece prices its thousands of transfers at once, by
        `Route.transfer_ms`'s formula."""
        return self._copy_figures

    @property
    def route_resource_table(self) -> list[list[tuple[int, ...]]]:
        """The resources a transfer from `src` to `dst` holds,
        `[src][dst]` (() on the diagonal): its route's links
        (`link_resources`)."""
        return self._route_resources

    def _copy_of(
        self, src: int, dst: int, route: Route | None
    ) -> Route | None:
        if route is None or (
            self.devices[src].node != self.devices[dst].node
        ):
            return route
        latency_ms, gbps = self.copy
        return Route(route.links, gbps, latency_ms)

    def link_resources(self, links) -> tuple[int, ...]:
        """The scheduler's resource ids of `links` (indices into
        `links`): they follow the devices' ids."""
        return tuple(self.num_devices + k for k in links)

    def _build_routes(self) -> list[list[Route | None]]:
        links: list[LinkSpec] = []
        index: dict[str, int] = {}

        def link(name: str, group: LinkGroup) -> int:
            if name not in index:
                index[name] = len(links)
                links.append(
                    LinkSpec(
                        name, group.kind, group.bandwidth_gbps,
                        group.latency_ms,
                    )
                )
            return index[name]

        n = self.num_devices
        routes: list[list[Route | None]] = [[None] * n for _ in range(n)]
        for s in range(n):
            for d in range(n):
                if s == d:
                    continue
                ids = self._route_links(s, d, link)
                group = [links[i] for i in ids]
                routes[s][d] = Route(
                    tuple(ids),
                    min(x.bandwidth_gbps for x in group),
                    sum(x.latency_ms for x in group),
                )
        self.links = tuple(links)
        return routes

    def _route_links(self, s: int, d: int, link: Any) -> list[int]:
        per = self.devices_per_node
        ns, nd = s // per, d // per
        if ns == nd:
            kind = self.intra.kind
            if kind in POINT_TO_POINT:
                return [link(f"{kind} {s}->{d}", self.intra)]
            return [
                link(f"{kind} {s} out", self.intra),
                link(f"{kind} {d} in", self.intra),
            ]
        nic_s = (s % per) % self.nics_per_node
        nic_d = (d % per) % self.nics_per_node
        return [
            link(f"nic {ns}.{nic_s} out", self.inter),
            link(f"nic {nd}.{nic_d} in", self.inter),
        ]


def _route_figures(
    routes: list[list[Route | None]],
) -> tuple[np.ndarray, np.ndarray]:
    """(latency ms, bandwidth GB/s) arrays of a route table, NaN where
    there is no route; read-only, as the machine is."""
    n = len(routes)
    latency = np.full((n, n), np.nan)
    bandwidth = np.full((n, n), np.nan)
    for s, row in enumerate(routes):
        for d, route in enumerate(row):
            if route is not None:
                latency[s, d] = route.latency_ms
                bandwidth[s, d] = route.bandwidth_gbps
    latency.flags.writeable = bandwidth.flags.writeable = False
    return latency, bandwidth


def _check_shape(nodes: int, per_node: int, nics: int) -> None:
    for key, value in (
        ("num_nodes", nodes),
        ("devices_per_node", per_node),
        ("nics_per_node", nics),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"`{key}` must be a positive integer. Received: "
                f"{key}={value!r}"
            )


def _us(value: float) -> float:
    return value / 1000.0


# Spec-sheet figures (float32, no tensor cores unless said so):
# P100 SXM2: NVIDIA Tesla P100 datasheet: 10.6 TFLOP/s, 16 GB HBM2 at
#   732 GB/s; NVLink 1.0 link 20 GB/s per direction.
# K80: NVIDIA Tesla K80 datasheet: 8.73 TFLOP/s, 24 GB, 480 GB/s per
#   board of two GK210 GPUs; a device here is one GK210 (what a framework
#   schedules on): 4.37 TFLOP/s, 12 GB, 240 GB/s. PCIe 3.0 x16: 15.75 GB/s.
# V100 SXM2: NVIDIA V100 datasheet: 15.7 TFLOP/s, 16 GB HBM2 at 900 GB/s,
#   300 GB/s NVLink 2.0 over 6 links of 25 GB/s per direction; a pair in
#   a fully connected 4-GPU node gets 2 links: 50 GB/s per direction.
# H100 SXM5: NVIDIA H100 datasheet: 67 TFLOP/s FP32, 80 GB HBM3 at
#   3.35 TB/s, NVLink 4 900 GB/s bidirectional: 450 GB/s per direction.
# InfiniBand (IBTA / Mellanox product briefs): FDR 56 Gb/s = 7 GB/s,
#   EDR 100 Gb/s = 12.5 GB/s, NDR 400 Gb/s = 50 GB/s.
# Latencies are typical small-message figures, not spec-sheet values.
_P100 = DeviceSpec("P100", 0, 10.6e12, 16 * GIB, 732.0)
_K80 = DeviceSpec("K80", 0, 4.37e12, 12 * GIB, 240.0)
_V100 = DeviceSpec("V100", 0, 15.7e12, 16 * GIB, 900.0)
_H100 = DeviceSpec("H100", 0, 67e12, 80 * GIB, 3350.0)
_IB_EDR = LinkGroup("nic", 12.5, _us(2.0))
_IB_FDR = LinkGroup("nic", 7.0, _us(2.0))
_IB_NDR = LinkGroup("nic", 50.0, _us(2.0))
_NVSWITCH_H100 = LinkGroup("nvswitch", 450.0, _us(2.0))

_PRESETS = {
    "p100x16": lambda: MachineModel(
        "p100x16", _P100, 4, 4, LinkGroup("nvlink", 20.0, _us(2.0)),
        _IB_EDR,
    ),
    "k80x64": lambda: MachineModel(
        "k80x64", _K80, 16, 4, LinkGroup("pcie", 15.75, _us(5.0)), _IB_FDR
    ),
    "v100x4": lambda: MachineModel(
        "v100x4", _V100, 1, 4, LinkGroup("nvlink", 50.0, _us(2.0))
    ),
    "h100x8": lambda: MachineModel("h100x8", _H100, 1, 8, _NVSWITCH_H100),
    "h100x64": lambda: MachineModel(
        "h100x64", _H100, 8, 8, _NVSWITCH_H100, _IB_NDR, nics_per_node=8
    ),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)


def load_machine(spec: str | None) -> MachineModel:
    """The machine to plan for.

    Args:
        spec: None for the attached TensorFlow devices; a preset name
            (see `PRESETS`); or the path of a JSON spec file.

    Returns:
        The `MachineModel`.
    """
    if spec is None:
        return live_machine()
    if spec in _PRESETS:
        return _PRESETS[spec]()
    if spec.endswith(".json") or os.path.exists(spec):
        if not os.path.exists(spec):
            raise ValueError(
                f"Machine spec file not found. Received: machine={spec!r}"
            )
        with open(spec) as f:
            return machine_from_dict(json.load(f), default_name=spec)
    raise ValueError(
        "`machine` must be a preset name or the path of a JSON spec file. "
        f"Received: machine={spec!r}. Presets: {', '.join(PRESETS)}"
    )


_DEVICE_KEYS = {
    "kind", "peak_tflops", "memory_gib", "memory_gbps",
    "launch_overhead_us",
}
_LINK_KEYS = {"kind", "bandwidth_gbps", "latency_us"}


def machine_from_dict(
    data: dict[str, Any], default_name: str = "custom"
) -> MachineModel:
    """A machine from the JSON spec schema of `docs/MACHINE.md`."""
    top = {"name", "num_nodes", "devices_per_node", "nics_per_node",
           "device", "intra_node", "inter_node"}
    _check_keys("machine spec", data, top, {"device", "intra_node"})
    d = data["device"]
    _check_keys("device", d, _DEVICE_KEYS, _DEVICE_KEYS - {
        "launch_overhead_us"})
    device = DeviceSpec(
        str(d["kind"]), 0, float(d["peak_tflops"]) * 1e12,
        int(float(d["memory_gib"]) * GIB), float(d["memory_gbps"]),
        _us(float(d.get("launch_overhead_us", 5.0))),
    )
    inter = data.get("inter_node")
    return MachineModel(
        str(data.get("name", default_name)), device,
        data.get("num_nodes", 1), data.get("devices_per_node", 1),
        _link_group("intra_node", data["intra_node"]),
        None if inter is None else _link_group("inter_node", inter),
        data.get("nics_per_node", 1),
    )


def _link_group(where: str, d: dict[str, Any]) -> LinkGroup:
    inter = where == "inter_node"
    _check_keys(where, d, _LINK_KEYS, _LINK_KEYS - ({"kind"} if inter
                                                      else set()))
    kind = "nic" if inter else str(d["kind"])
    return LinkGroup(
        kind, float(d["bandwidth_gbps"]), _us(float(d["latency_us"]))
    )


def _check_keys(
    where: str, d: Any, allowed: set[str], required: set[str]
) -> None:
    if not isinstance(d, dict):
        raise ValueError(
            f"`{where}` must be a JSON object. Received: {d!r}"
        )
    unknown = sorted(set(d) - allowed)
    missing = sorted(required - set(d))
    if unknown or missing:
        raise ValueError(
            f"Bad `{where}` in machine spec: unknown keys {unknown}, "
            f"missing keys {missing}. Received: keys={sorted(d)}. "
            f"Allowed: {sorted(allowed)}"
        )


# Between DTensor clients (hosts): gRPC over TCP, nominal (not measured;
# 10 GbE-class). docs/MULTIHOST.md.
CLIENT_LINK = LinkGroup("network", 1.25, 0.05)

# Nominal figures for attached devices; measured costs do not use the
# FLOP/s, only memory capacity and links matter to the simulator.
_GPU_TABLE = {
    "H100": _H100, "V100": _V100, "P100": _P100, "K80": _K80,
    "A100": DeviceSpec("A100", 0, 19.5e12, 40 * GIB, 1555.0),
}


def live_machine() -> MachineModel:
    """The attached TensorFlow devices as one node (costs measured).

    Links, how many devices compute at once and the fixed cost of a step
    are measured on them once (`calibration.py`); nominal figures where
    that is turned off.

    In DTensor's multi-client mode the machine is the clients as nodes
    of this process's devices each: this client's devices are measured,
    and the link between clients (`CLIENT_LINK`, nominal) is the
    network, so the search prices traffic between hosts."""
    from flexflow_keras import calibration, devices

    names = devices.device_names()
    local = devices.local_device_names() or names
    nodes = len(names) // len(local)
    if devices.device_kind() == "GPU":
        spec = _live_gpu_spec()
        intra = LinkGroup("pcie", 15.75, _us(5.0))
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        spec = DeviceSpec(
            "CPU", 0, 50e9, total // max(len(local), 1), 20.0,
            _us(2.0),
        )
        # Virtual CPU devices share host memory: a copy is a memcpy.
        intra = LinkGroup("host", 10.0, _us(5.0))
    inter = CLIENT_LINK if nodes > 1 else None
    measured = calibration.live_calibration(local)
    if measured is None:
        return MachineModel("live", spec, nodes, len(local), intra, inter,
                            live=True)
    # Op costs are measured; the spec's bandwidth and launch cost are what
    # `cost.update_ms` reads, so they are the measured update's.
    spec = dataclasses.replace(
        spec, memory_gbps=measured.update_gbps,
        launch_overhead_ms=measured.update_overhead_ms,
    )
    intra = LinkGroup(
        intra.kind, measured.link_gbps, measured.link_latency_ms
    )
    groups = measured.compute_groups
    return MachineModel(
        "live", spec, nodes, len(local), intra, inter, live=True,
        compute_groups=None if groups >= len(local) else groups,
        step_overhead_ms=measured.step_overhead_ms,
        # The measured all-reduce is within one client; across clients
        # the ring over the links prices the network.
        allreduce=None if nodes > 1 else (
            measured.allreduce_latency_ms, measured.allreduce_gbps
        ),
        # The links are fitted to it (per part, `calibration.py`).
        allgather=None if nodes > 1 else (
            measured.link_latency_ms, measured.link_gbps
        ),
        call_overhead_ms=measured.call_overhead_ms,
        copy=(measured.copy_latency_ms, measured.copy_gbps),
    )


def _live_gpu_spec() -> DeviceSpec:
    import tensorflow as tf

    gpu = tf.config.list_physical_devices("GPU")[0]
    name = tf.config.experimental.get_device_details(gpu).get(
        "device_name", "GPU"
    )
    for key, spec in _GPU_TABLE.items():
        if key in name:
            return dataclasses.replace(spec, kind=name)
    return DeviceSpec(name, 0, 10e12, 16 * GIB, 500.0)
