"""What creating a DTensor variable costs, for a shape seen before and a new one.

The runtime makes one `DVariable` per Keras variable a step touches
(`ModelStepExecutor._realize`). DTensor runs each eager op through its SPMD
expansion once per distinct signature (op, shapes, layouts) and caches the
result, so a deep model's start-up pays an expansion for each distinct
variable shape on top of a smaller cost for each variable. This prints both
figures on a `--devices` CPU mesh:
`--count` variables of one shape, then `--count` of distinct shapes.

Usage:
    python bench/dvariable_bench.py [--devices 4] [--count 300]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402


def per_variable_ms(shapes: list[tuple[int, ...]], mesh) -> float:
    """Mean milliseconds to create a replicated DVariable of each shape
    (the initial values are made first and not timed)."""
    values = [dtensor.call_with_layout(
        tf.zeros, dtensor.Layout.replicated(mesh, len(shape)), shape)
        for shape in shapes]
    start = time.perf_counter()
    made = [dtensor.DVariable(value) for value in values]
    elapsed = time.perf_counter() - start
    del made
    return elapsed / len(shapes) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
    mesh = dtensor.create_mesh([("x", args.devices)], device_type="CPU")
    per_variable_ms([(3, 3)], mesh)  # the first op on the mesh, not timed
    same = per_variable_ms([(64, 64)] * args.count, mesh)
    distinct = per_variable_ms(
        [(i + 1, 7) for i in range(args.count)], mesh)
    print(f"{args.count} DVariables on {args.devices} virtual CPUs: "
          f"{same:.1f} ms each of one shape, {distinct:.1f} ms each of "
          f"distinct shapes")


if __name__ == "__main__":
    main()
