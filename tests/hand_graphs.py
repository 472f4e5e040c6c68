"""OpGraphs built by hand, so tests fix the SOAP dims rather than op_specs."""

from flexflow_keras.graph import PARAMETER, SAMPLE, Op, OpGraph, TensorInfo


def hand_graph(batch: int = 8) -> OpGraph:
    """x (batch, 4) -> dense_0 (6) -> dense_1 (6) -> dense_2 (2) -> relu.

    Built by hand so that the SOAP dims are fixed here, not by op_specs:
    Dense may split sample and parameter dims, `relu` the sample dim only.
    """
    tensors = {"x": TensorInfo("x", (batch, 4), "float32")}
    ops, prev = [], "x"
    for name, units, split in (
        ("dense_0", 6, {0: SAMPLE, 1: PARAMETER}),
        ("dense_1", 6, {0: SAMPLE, 1: PARAMETER}),
        ("dense_2", 2, {0: SAMPLE, 1: PARAMETER}),
        ("relu", 2, {0: SAMPLE}),
    ):
        out = f"{name}:0"
        tensors[out] = TensorInfo(out, (batch, units), "float32", name)
        ops.append(Op(
            name=name, type="Dense" if split.get(1) else "Activation",
            inputs=(prev,), outputs=(out,),
            input_shapes=(tensors[prev].shape,),
            output_shapes=((batch, units),), dtype="float32",
            partitionable=split,
        ))
        prev = out
    return OpGraph(tuple(ops), tensors, ("x",), (prev,), batch)
