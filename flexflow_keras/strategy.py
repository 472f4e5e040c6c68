"""Parallel configs and strategies: values the search proposes.

`ParallelConfig.dims` has one degree per dim of the op's output 0, batch
first; part i (row-major over dims) lives on `device_ids[i]`, so
`np.reshape(device_ids, dims)` is the op's device grid.
"""

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping

from flexflow_keras.graph import Op, OpGraph


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How one op's output is split over devices.

    Args:
        dims: Parts per output dim, batch first; `(4, 1)` splits the batch.
        device_ids: One device per part, row-major over `dims`.
    """

    dims: tuple[int, ...]
    device_ids: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(
            self, "device_ids", tuple(int(d) for d in self.device_ids)
        )
        if any(d < 1 for d in self.dims):
            raise ValueError(
                "Every degree in `dims` must be >= 1. "
                f"Received: dims={self.dims}"
            )
        if math.prod(self.dims) != len(self.device_ids):
            raise ValueError(
                "Need one device per part: prod(dims) == len(device_ids). "
                f"Received: dims={self.dims}, device_ids={self.device_ids}"
            )
        if len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError(
                "`device_ids` must be distinct within an op. "
                f"Received: device_ids={self.device_ids}"
            )

    @property
    def num_parts(self) -> int:
        return len(self.device_ids)

    def __str__(self) -> str:
        dims = ",".join(map(str, self.dims))
        ids = ",".join(map(str, self.device_ids))
        return f"num_dims({len(self.dims)}) dims[{dims}] device_ids[{ids}]"


def largest_divisor(size: int, limit: int) -> int:
    """The most parts (<= `limit`) that split `size` evenly; 1 at least.

    The one rule for a dim that `limit` devices do not divide: split it
    as far as it divides (a batch of 50 on 4 devices: 2 parts), never
    pad it, which would change losses, metrics and BatchNormalization
    statistics.
    """
    return max(
        d for d in range(1, max(min(size, limit), 1) + 1) if size % d == 0
    )


def data_parallel_config(op: Op, num_devices: int) -> ParallelConfig:
    """Data parallelism for one op, whatever its batch: the search's
    starting point and the baseline it is measured against.

    The batch splits over as many devices as divide it
    (`largest_divisor`); a batch that `num_devices` does not divide
    (50, 7 or 1 on 4 devices) leaves devices over, which the op's
    largest split of one other dim it may partition takes (`(2, 2)` for
    a Dense at batch 50), so the baseline still uses the machine. An op
    whose batch dim may not be split runs whole on device 0, the only
    valid config without a sample split.
    """
    shape = op.output_shape or (1,)
    dims = [1] * max(op.rank, 1)
    if 0 in op.partitionable:
        dims[0] = largest_divisor(shape[0], num_devices)
        rest = num_devices // dims[0]
        others = [d for d in sorted(op.partitionable) if 0 < d < len(dims)]
        if rest > 1 and others:
            # The first dim reaching the largest degree: ops in a chain
            # then split the same dim (sequence before channels).
            best = max(others, key=lambda d: largest_divisor(shape[d], rest))
            dims[best] = largest_divisor(shape[best], rest)
    return ParallelConfig(tuple(dims), tuple(range(math.prod(dims))))


def validate_config(
    op: Op, config: ParallelConfig, num_devices: int
) -> None:
    """Raises a ValueError naming `op` when `config` cannot run it.

    Rules: one degree per output dim; only dims the op may partition are
    split; every degree divides its dim; device ids exist on a machine of
    `num_devices` devices (distinctness and `prod(dims) ==
    len(device_ids)` are checked by `ParallelConfig` itself).
    """
    rank = max(op.rank, 1)
    if len(config.dims) != rank:
        raise ValueError(
            f"Op '{op.name}' has a rank-{op.rank} output "
            f"{op.output_shape}, so `dims` needs {rank} entries. "
            f"Received: dims={config.dims}. Use 1 for dims that are "
            "not split."
        )
    shape = op.output_shape or (1,)
    for dim, degree in enumerate(config.dims):
        if degree == 1:
            continue
        if dim not in op.partitionable:
            allowed = ", ".join(
                f"{d} ({kind})"
                for d, kind in sorted(op.partitionable.items())
            )
            varying = (" Lengths that change from batch to batch (the "
                       "model's data, or its validation data, came in "
                       "several) are never split."
                       if any(op.varying_inputs) else "")
            raise ValueError(
                f"Op '{op.name}' ({op.type}) cannot split output dim {dim}. "
                f"Received: dims={config.dims}. Dims it may split: "
                f"{allowed or 'none'}; use 1 for the others.{varying}"
            )
        if shape[dim] % degree:
            raise ValueError(
                f"Op '{op.name}' output dim {dim} has size {shape[dim]}, "
                f"which {degree} parts cannot divide evenly. Received: "
                f"dims={config.dims}. Use a degree that divides "
                f"{shape[dim]}."
            )
    bad = [i for i in config.device_ids if not 0 <= i < num_devices]
    if bad:
        raise ValueError(
            f"Op '{op.name}' names devices the machine lacks. Received: "
            f"device_ids={config.device_ids}; the machine has "
            f"{num_devices} devices, ids 0..{num_devices - 1}."
        )


def check_known_ops(
    names: Iterable[str], graph: OpGraph, where: str = "The strategy"
) -> None:
    """Raises a ValueError when `names` holds ops `graph` lacks."""
    unknown = [name for name in names if name not in graph]
    if unknown:
        raise ValueError(
            f"{where} names ops the model lacks: {unknown}. Is it for "
            f"another model? Model ops: {[op.name for op in graph]}"
        )


class Strategy(Mapping):
    """Op name -> ParallelConfig, for every op of one graph. Read-only.

    Args:
        configs: Mapping of op name to `ParallelConfig`.
    """

    def __init__(self, configs: Mapping[str, ParallelConfig]):
        self._configs = dict(configs)

    @classmethod
    def data_parallel(cls, graph: OpGraph, num_devices: int) -> "Strategy":
        """Every op's `data_parallel_config`: the batch split over all
        devices where it divides evenly, else as far as it divides with
        other dims for the rest. Valid for any batch size."""
        return cls(
            {op.name: data_parallel_config(op, num_devices) for op in graph}
        )

    def validate(self, graph: OpGraph, num_devices: int) -> None:
        """Raises a ValueError unless this strategy can run `graph`.

        Every op of the graph needs a config, no name may be foreign to
        the graph, and each config must pass `validate_config`.

        Args:
            graph: The model's `OpGraph`.
            num_devices: Devices of the machine (ids 0..n-1).
        """
        check_known_ops(self._configs, graph)
        missing = [op.name for op in graph if op.name not in self._configs]
        if missing:
            raise ValueError(
                f"The strategy has no config for ops {missing}. Every op "
                "needs one; `Strategy.data_parallel(graph, n)` gives a "
                "complete start."
            )
        for op in graph:
            validate_config(op, self._configs[op.name], num_devices)

    def replace(self, name: str, config: ParallelConfig) -> "Strategy":
        """A new strategy with one op's config changed."""
        configs = dict(self._configs)
        configs[name] = config
        return Strategy(configs)

    def __getitem__(self, name: str) -> ParallelConfig:
        return self._configs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._configs == other._configs

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._configs.items())))

    def __repr__(self) -> str:
        return f"Strategy({self._configs!r})"

    def to_text(self) -> str:
        """FlexFlow's printed form, one op a line."""
        return "".join(
            f"[{name}] {config}\n" for name, config in self._configs.items()
        )
