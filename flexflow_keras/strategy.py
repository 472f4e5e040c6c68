"""Parallel configs and strategies: values the search proposes.

`ParallelConfig.dims` has one degree per dim of the op's output 0, batch
first; part i (row-major over dims) lives on `device_ids[i]`, so
`np.reshape(device_ids, dims)` is the op's device grid.
"""

import dataclasses
import math
from collections.abc import Iterator, Mapping

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


def data_parallel_config(op: Op, num_devices: int) -> ParallelConfig:
    """Batch split over devices 0..n-1, the search's starting point."""
    batch = op.output_shape[0] if op.rank else 1
    degree = num_devices if op.rank and batch % num_devices == 0 else 1
    dims = (degree,) + (1,) * max(op.rank - 1, 0)
    return ParallelConfig(dims or (1,), tuple(range(degree)))


class Strategy(Mapping):
    """Op name -> ParallelConfig, for every op of one graph. Read-only.

    Args:
        configs: Mapping of op name to `ParallelConfig`.
    """

    def __init__(self, configs: Mapping[str, ParallelConfig]):
        self._configs = dict(configs)

    @classmethod
    def data_parallel(cls, graph: OpGraph, num_devices: int) -> "Strategy":
        """Every op splits the batch over all devices.

        Raises a ValueError when the batch does not divide evenly.
        """
        if graph.batch_size % num_devices:
            raise ValueError(
                "Data parallelism needs the global batch to divide evenly "
                f"over the devices. Received: batch_size={graph.batch_size}"
                f", num_devices={num_devices}. Use a batch size that is a "
                f"multiple of {num_devices}."
            )
        return cls(
            {op.name: data_parallel_config(op, num_devices) for op in graph}
        )

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
