"""Does DTensor train one function over several meshes? A probe, case by case.

Why this exists: docs/ARCHITECTURE.md ("Several meshes in one function")
decides that a model's own training step runs as ONE DTensor function on
ONE mesh (which may have several axes), never split over several meshes.
This script is the evidence. It runs a two-matmul model

    loss = mean(tanh(tanh(x @ w1) @ w2) ** 2),   x: 16 x 8, w1, w2: 8 x 8

in one `tf.function` per case on 4 virtual CPU devices, `w1` a DVariable
on mesh A and `w2` one on mesh B, and compares the loss, the gradients
and the SGD-updated weights with the same computation in plain
TensorFlow (`np.allclose`). A tensor moves between meshes the only way
DTensor offers: `dtensor.relayout` to a replicated layout on its mesh,
then `dtensor.copy_to_mesh` to a replicated layout on the other (then a
relayout to a sharded one where the case shards).

The cases (`--list` prints them), named `MESH-DIRECTION[-SHARDING][-sgd]`:
  MESH       dis: A is a 1-D mesh over CPU:0,1, B one over CPU:2,3;
             one: A over CPU:0,1, B over CPU:2 alone;
             r3: A over CPU:0,1,2, B over CPU:3 alone;
             ov: A over CPU:0,1, B over CPU:1,2 (overlapping, same size);
             sub23 / sub01: A is a 1-D mesh over CPU:0..3, B a separate
             1-D mesh over CPU:2,3 / CPU:0,1 (a sub-mesh);
             view: B is a 2 x 2 mesh over the SAME 4 devices as A;
             nd: one 2 x 2 mesh, no copies: each op has its own layouts
             (x @ w1 batch on axis 0, tanh(.) @ w2 channels on axis 1,
             the loss batch on axis 0 and channels on axis 1).
  DIRECTION  forward-ABA: x @ w1 on A, @ w2 on B, loss on A, no grads;
             train-AB: loss on B, gradients of w1 (flowing back to A)
             and w2; train-ABA: loss back on A, gradients of both;
             train-Bonly: loss on B, gradient of w2 only.
  SHARDING   Ashard: the batch split over A's axis (x and the loss's
             input); Bshard: the batch split over B's first axis (the
             activation copied in); ABshard: both. Weights replicated.
  -sgd       the function also applies `w -= 0.1 * grad` (the gradient
             relaid to its variable's layout first).
  -counter   with -sgd: the rate is 0.1 / a step counter, one variable on
             mesh A that the step increments and copies to B for w2's
             update, as a Keras optimizer reads its `iterations` (and a
             schedule its rate) in every weight's update. Used on B as
             it is, DTensor refuses it ("All inputs to
             `tf_device.Cluster` must have same mesh configuration").

Each case runs in its own subprocess with a timeout, because the failure
being probed is a hang (DTensor's per-mesh functions waiting on each
other for ever); a case that outlives the timeout is reported as HANG.

Usage:
    python bench/dtensor_mesh_probe.py [--timeout 60] [--select view-]
        [--inter-op N] [--list]
    python bench/dtensor_mesh_probe.py --case view-train-ABA-Bshard-sgd
        (one case in this process, no timeout: prints one line)

The table's "earlier" column is what was measured by hand before this
script existed (issue 22), where that covered the case.

Measured (TF 2.21, 4 virtual CPUs on a busy 2-core VM, --timeout 60;
648 s in all; a case that ends takes 3-6 s, a hung one sits idle):
    sub23-forward-ABA, sub23-train-AB    HANG
    sub01-forward-ABA, sub01-train-AB    HANG
    sub23-train-Bonly, sub01-train-Bonly ok
    view-forward-ABA, view-train-AB      ok
    view-train-ABA (with and without -sgd) ok
    view-forward-ABA-Bshard, view-train-AB-Bshard  ok
    view-train-ABA-{Ashard,Bshard,ABshard} (with and without -sgd)  HANG
    nd-forward-ABA, nd-train-ABA, nd-train-ABA-sgd  ok
The hangs stay with `--inter-op 16` (checked for sub23-forward-ABA and
view-train-ABA-Ashard[-sgd]), so they are not a thread pool too small
for 4 devices on 2 cores.

What made the sharded cases hang (2026-12-02): DTensor's all-reduce
combining (`DTensorAllReduceCombineOptimization`, on by default). In
the graph DTensor built for dis-train-AB-Ashard (`TF_DUMP_GRAPH_PREFIX`
with `TF_CPP_VMODULE=dtensor_device=4`), mesh A's function has ONE
`CollectiveReduceV2`: the forward's all-gather of `tanh(x @ w1)` before
its copy to B (`Tanh/DTensorAllGatherOp`) merged with the backward's
all-reduce of w1's gradient (`.../DTensorAllReduceOp/
CombinedReduceUpdateSlice`), which needs B's result: a cycle through
the other mesh that never completes. `--no-combine` runs every case
with the pass off (`DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0`).
The dis, one, r3, ov and -counter cases were added then. Same VM;
pass on: --timeout 40 (the first 10 dis cases, then the earlier ones);
pass off: every case, --timeout 30, 349 s; ok = equal to plain
TensorFlow (loss, gradients, updated weights):

    case                               pass on (default)   pass off
    dis-forward-ABA[-Ashard,-Bshard]   ok                  ok
    dis-train-AB, -Bshard              ok                  ok
    dis-train-AB-Ashard                HANG                ok
    dis-train-ABA, -sgd                ok                  ok
    dis-train-ABA-Ashard               HANG                ok
    dis-train-ABA-ABshard-sgd          HANG                ok
    dis-/view-train-ABA-ABshard-sgd-counter  (not run)     ok
    one-forward-ABA, one-train-ABA-sgd (not run)           HANG
    r3-forward-ABA                     (not run)           HANG
    ov-forward-ABA, ov-train-ABA-ABshard-sgd[-counter] (not run) ok
    view-* (every case, sharded, sgd)  sharded ABA HANG    ok
    nd-*                               ok                  ok
    sub23-/sub01-forward-ABA, -train-AB HANG               HANG
    sub23-/sub01-train-Bonly           ok                  ok

So with the pass off one DTensor function trains over several meshes
that have the SAME NUMBER OF DEVICES, split and updated, whether they
are disjoint (dis), overlap (ov: CPU:0,1 and CPU:1,2) or are views of
the same devices (view); a round trip between meshes of different sizes
hangs, disjoint or not, even unsplit with no collective at all (sub23,
sub01: 4 and 2 devices; one: 2 and 1; r3: 3 and 1; their graphs have
only host sends and receives, and async eager execution does not help).
dtensor_device.cc starts every mesh's function, then joins them, so the
functions do run at once; why unequal sizes hang was not found.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np

NUM_DEVICES = 4
BATCH, FEATURES = 16, 8
LEARNING_RATE = 0.1
SEED = 0


@dataclasses.dataclass(frozen=True)
class Case:
    """One probe: which meshes, which way the data flows, what is split.

    Args:
        mesh: "dis", "one", "r3", "ov", "sub23", "sub01", "view" or
            "nd" (see the module docstring).
        direction: "forward-ABA", "train-AB", "train-ABA" or
            "train-Bonly".
        sharding: "", "Ashard", "Bshard" or "ABshard".
        sgd: Whether the function also updates the weights.
        earlier: The result measured before this script existed, if any
            ("ok", "HANG", "ERROR"), shown beside the new one.
    """

    mesh: str
    direction: str
    sharding: str = ""
    sgd: bool = False
    counter: bool = False
    earlier: str = ""

    @property
    def name(self) -> str:
        parts = [self.mesh, self.direction, self.sharding,
                 "sgd" if self.sgd else "",
                 "counter" if self.counter else ""]
        return "-".join(p for p in parts if p)

    @property
    def a_sharded(self) -> bool:
        return self.sharding in ("Ashard", "ABshard")

    @property
    def b_sharded(self) -> bool:
        return self.sharding in ("Bshard", "ABshard")

    @property
    def trains(self) -> bool:
        return self.direction.startswith("train")


CASES = (
    Case("dis", "forward-ABA"),
    Case("dis", "forward-ABA", "Ashard"),
    Case("dis", "forward-ABA", "Bshard"),
    Case("dis", "train-AB"),
    Case("dis", "train-AB", "Ashard"),
    Case("dis", "train-AB", "Bshard"),
    Case("dis", "train-ABA"),
    Case("dis", "train-ABA", sgd=True),
    Case("dis", "train-ABA", "Ashard"),
    Case("dis", "train-ABA", "ABshard", sgd=True),
    Case("dis", "train-ABA", "ABshard", sgd=True, counter=True),
    Case("one", "forward-ABA"),
    Case("one", "train-ABA", sgd=True),
    Case("r3", "forward-ABA"),
    Case("ov", "forward-ABA"),
    Case("ov", "train-ABA", "ABshard", sgd=True),
    Case("ov", "train-ABA", "ABshard", sgd=True, counter=True),
    Case("sub23", "forward-ABA", earlier="HANG"),
    Case("sub23", "train-AB", earlier="HANG"),
    Case("sub23", "train-Bonly", earlier="ok"),
    Case("sub01", "forward-ABA", earlier="HANG"),
    Case("sub01", "train-AB", earlier="HANG"),
    Case("sub01", "train-Bonly", earlier="ok"),
    Case("view", "forward-ABA", earlier="ok"),
    Case("view", "train-AB", earlier="ok"),
    Case("view", "train-ABA", earlier="ok"),
    Case("view", "train-ABA", sgd=True, earlier="ok"),
    Case("view", "train-ABA", "Ashard", earlier="ok"),
    Case("view", "train-ABA", "Bshard", earlier="ok"),
    Case("view", "train-ABA", "ABshard", earlier="ok"),
    Case("view", "forward-ABA", "Bshard"),
    Case("view", "train-AB", "Bshard"),
    Case("view", "train-ABA", "Ashard", sgd=True),
    Case("view", "train-ABA", "Bshard", sgd=True, earlier="ERROR"),
    Case("view", "train-ABA", "ABshard", sgd=True, earlier="HANG"),
    Case("view", "train-ABA", "ABshard", sgd=True, counter=True),
    Case("nd", "forward-ABA"),
    Case("nd", "train-ABA", earlier="ok"),
    Case("nd", "train-ABA", sgd=True, earlier="ok"),
)
CASES_BY_NAME = {case.name: case for case in CASES}


# --- The child: one case, in this process --------------------------------


def tensorflow_with_cpus(count: int, inter_op_threads: int):
    """Imports TensorFlow with `count` virtual CPU devices.

    The split must happen before anything initialises TensorFlow's
    devices, as in flexflow_keras/devices.py; this script imports no
    flexflow_keras so that the probe depends on TensorFlow alone.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    if inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(
            inter_op_threads)
    return tf


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, w1 and w2, the same every run (scaled so tanh is not flat)."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    w1, w2 = (0.5 * rng.standard_normal((FEATURES, FEATURES))
              .astype(np.float32) for _ in range(2))
    return x, w1, w2


def reference(tf, case: Case) -> dict[str, np.ndarray]:
    """The case's loss, gradients and updated weights in plain TF.

    Returns:
        "loss", then "grad_w1"/"grad_w2" for the weights the case
        differentiates, and "w1"/"w2" after the update if it updates.
    """
    x, w1_value, w2_value = inputs()
    with tf.device("/CPU:0"):
        w1, w2 = tf.Variable(w1_value), tf.Variable(w2_value)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                tf.square(tf.tanh(tf.tanh(x @ w1) @ w2)))
        expected = {"loss": loss.numpy()}
        if not case.trains:
            return expected
        weights = differentiated({"w1": w1, "w2": w2}, case)
        grads = tape.gradient(loss, list(weights.values()))
        for (name, weight), grad in zip(weights.items(), grads):
            expected["grad_" + name] = grad.numpy()
            if case.sgd:
                expected[name] = (weight - LEARNING_RATE * grad).numpy()
    return expected


def differentiated(weights: dict, case: Case) -> dict:
    """The weights whose gradients the case takes, by name."""
    if case.direction == "train-Bonly":
        return {"w2": weights["w2"]}
    return weights


def device_names(count: int) -> list[str]:
    return [f"/job:localhost/replica:0/task:0/device:CPU:{i}"
            for i in range(count)]


# Two 1-D meshes by case kind: the device indices of A and of B.
ONE_D_MESHES = {
    "dis": ((0, 1), (2, 3)),
    "ov": ((0, 1), (1, 2)),
    "one": ((0, 1), (2,)),
    "r3": ((0, 1, 2), (3,)),
    "sub23": ((0, 1, 2, 3), (2, 3)),
    "sub01": ((0, 1, 2, 3), (0, 1)),
}


def meshes_of(dtensor, case: Case) -> tuple:
    """Mesh A (weight w1, input x) and mesh B (weight w2).

    For "nd" both are the one 2 x 2 mesh: there the probe is the layouts.
    """
    names = device_names(NUM_DEVICES)
    if case.mesh == "nd":
        mesh = dtensor.create_mesh([("batch", 2), ("model", 2)],
                                   devices=names, mesh_name="nd")
        return mesh, mesh
    if case.mesh == "view":
        return (dtensor.create_mesh([("a", NUM_DEVICES)], devices=names,
                                    mesh_name="A"),
                dtensor.create_mesh([("b0", 2), ("b1", 2)], devices=names,
                                    mesh_name="B"))
    a, b = ONE_D_MESHES[case.mesh]
    return (dtensor.create_mesh([("a", len(a))],
                                devices=[names[i] for i in a], mesh_name="A"),
            dtensor.create_mesh([("b0", len(b))],
                                devices=[names[i] for i in b], mesh_name="B"))


def batch_split(dtensor, mesh, split: bool):
    """A rank-2 layout on `mesh`, rows over its first axis if `split`."""
    if not split:
        return dtensor.Layout.replicated(mesh, 2)
    return dtensor.Layout.batch_sharded(mesh, mesh.dim_names[0], 2)


def move(dtensor, tensor, source, layout):
    """`tensor`, on mesh `source`, onto `layout`: replicated on `source`,
    copied to `layout`'s mesh replicated, then relaid to `layout`.

    The source mesh is passed because `fetch_layout` works only eagerly.
    """
    rank = len(tensor.shape)
    tensor = dtensor.relayout(tensor, dtensor.Layout.replicated(source, rank))
    tensor = dtensor.copy_to_mesh(
        tensor, dtensor.Layout.replicated(layout.mesh, rank))
    return dtensor.relayout(tensor, layout)


def two_mesh_loss(dtensor, tf, case: Case, mesh_a, mesh_b, x, w1, w2):
    """The loss with x @ w1 on A and tanh(.) @ w2 on B (then back)."""
    a_layout = batch_split(dtensor, mesh_a, case.a_sharded)
    b_layout = batch_split(dtensor, mesh_b, case.b_sharded)
    hidden = move(dtensor, tf.tanh(x @ w1), mesh_a, b_layout)
    out = tf.tanh(hidden @ w2)
    if case.direction in ("forward-ABA", "train-ABA"):
        out = move(dtensor, out, mesh_b, a_layout)
    return tf.reduce_mean(tf.square(out))


def one_mesh_loss(dtensor, tf, mesh, x, w1, w2):
    """The loss on one 2 x 2 mesh, each op on layouts of its own."""
    unsharded = dtensor.UNSHARDED
    batch_on_0 = dtensor.Layout(["batch", unsharded], mesh)
    channels_on_1 = dtensor.Layout([unsharded, "model"], mesh)
    both = dtensor.Layout(["batch", "model"], mesh)
    hidden = tf.tanh(dtensor.relayout(x, batch_on_0) @ w1)
    hidden = dtensor.relayout(hidden, dtensor.Layout.replicated(mesh, 2))
    out = dtensor.relayout(tf.tanh(hidden @ w2), channels_on_1)
    return tf.reduce_mean(tf.square(dtensor.relayout(out, both)))


def build(dtensor, tf, case: Case):
    """The case's DTensor input, weights and step function.

    Returns:
        (x, {"w1": DVariable, "w2": DVariable}, step) where `step(x)`
        returns the loss and, if the case trains, the gradients of the
        weights it differentiates (and applies SGD if the case updates).
    """
    x_value, w1_value, w2_value = inputs()
    mesh_a, mesh_b = meshes_of(dtensor, case)
    if case.mesh == "nd":
        w2_layout = dtensor.Layout([dtensor.UNSHARDED, "model"], mesh_b)
    else:
        w2_layout = dtensor.Layout.replicated(mesh_b, 2)
    weights = {
        "w1": dtensor.DVariable(dtensor.copy_to_mesh(
            w1_value, dtensor.Layout.replicated(mesh_a, 2))),
        "w2": dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(
            w2_value, dtensor.Layout.replicated(mesh_b, 2)), w2_layout)),
    }
    x = dtensor.relayout(
        dtensor.copy_to_mesh(x_value, dtensor.Layout.replicated(mesh_a, 2)),
        batch_split(dtensor, mesh_a, case.a_sharded))

    def loss_of(x):
        if case.mesh == "nd":
            return one_mesh_loss(dtensor, tf, mesh_a, x, weights["w1"],
                                 weights["w2"])
        return two_mesh_loss(dtensor, tf, case, mesh_a, mesh_b, x,
                             weights["w1"], weights["w2"])

    counter = dtensor.DVariable(dtensor.copy_to_mesh(
        tf.constant(0.0), dtensor.Layout.replicated(mesh_a, 0))
    ) if case.counter else None

    def step(x):
        if not case.trains:
            return loss_of(x), []
        chosen = list(differentiated(weights, case).values())
        with tf.GradientTape() as tape:
            loss = loss_of(x)
        grads = tape.gradient(loss, chosen)
        if case.sgd:
            rates = {}
            if case.counter:
                counter.assign_add(1.0)
                on_a = LEARNING_RATE / counter  # 0.1 at the first step
                rates = {mesh_a: on_a,
                         mesh_b: move(dtensor, on_a, mesh_a,
                                      dtensor.Layout.replicated(mesh_b, 0))}
            for weight, grad in zip(chosen, grads):
                grad = dtensor.relayout(grad, weight.layout)
                rate = (rates[weight.layout.mesh] if case.counter
                        else LEARNING_RATE)
                weight.assign_sub(rate * grad)
        return loss, grads

    return x, weights, tf.function(step, autograph=False)


def to_numpy(dtensor, tensor) -> np.ndarray:
    """A DTensor's global value (relaid to replicated, one copy read)."""
    layout = dtensor.fetch_layout(tensor)
    if not layout.is_fully_replicated():
        tensor = dtensor.relayout(
            tensor, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.unpack(tensor)[0].numpy()


def measured(dtensor, tf, case: Case) -> dict[str, np.ndarray]:
    """Runs the case's step once; its results keyed as `reference`'s.

    `async_wait` and reading every output make an error that DTensor
    raises asynchronously surface here, not at exit.
    """
    from tensorflow.python.eager import context

    x, weights, step = build(dtensor, tf, case)
    loss, grads = step(x)
    context.async_wait()
    got = {"loss": to_numpy(dtensor, loss)}
    names = differentiated(weights, case) if case.trains else {}
    for name, grad in zip(names, grads):
        got["grad_" + name] = to_numpy(dtensor, grad)
        if case.sgd:
            got[name] = to_numpy(dtensor, weights[name].read_value())
    return got


def first_message_line(error: BaseException) -> str:
    """The line of a TF error that names the failure, not its framing."""
    text = getattr(error, "message", None) or str(error)
    framing = ("Graph execution error", "Detected at node", "File ",
               "Traceback", "[[", "{{")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(framing):
            return f"{type(error).__name__}: {line}"
    return type(error).__name__


def run_case(name: str, inter_op_threads: int) -> str:
    """Runs one case here; returns "ok", "WRONG: ..." or "ERROR: ..."."""
    case = CASES_BY_NAME[name]
    tf = tensorflow_with_cpus(NUM_DEVICES, inter_op_threads)
    from tensorflow.experimental import dtensor

    expected = reference(tf, case)
    try:
        got = measured(dtensor, tf, case)
    except Exception as error:  # noqa: BLE001  (every failure is a result)
        return "ERROR: " + first_message_line(error)
    wrong = [key for key in expected
             if not np.allclose(got[key], expected[key], rtol=1e-5,
                                atol=1e-6)]
    if wrong:
        worst = max(float(np.max(np.abs(got[k] - expected[k])))
                    for k in wrong)
        return f"WRONG: {', '.join(wrong)} (max abs diff {worst:.3g})"
    return "ok"


# --- The parent: every case in a subprocess, with a timeout -------------


COMBINE_SWITCH = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def run_in_subprocess(name: str, timeout_s: float,
                      inter_op_threads: int) -> tuple[str, float]:
    """One case in a fresh Python (its own 4 devices); (result, seconds).

    A fresh process per case because a hung DTensor function cannot be
    cancelled, and the devices are set once per process.
    """
    command = [sys.executable, os.path.abspath(__file__), "--case", name,
               "--inter-op", str(inter_op_threads)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return "HANG (timeout)", time.perf_counter() - start
    seconds = time.perf_counter() - start
    results = [line[len("RESULT "):] for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    if results:
        return results[-1], seconds
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"ERROR: exit {done.returncode}: {tail}", seconds


def print_table(cases: list[Case], timeout_s: float,
                inter_op_threads: int) -> None:
    """Runs `cases` one after another, printing a row as each ends."""
    width = max(len(case.name) for case in cases) + 2
    combining = os.environ.get(COMBINE_SWITCH, "default")
    print(f"{NUM_DEVICES} virtual CPUs, timeout {timeout_s:g} s, "
          f"inter-op threads {inter_op_threads or 'default'}, "
          f"{COMBINE_SWITCH}={combining}")
    print(f"{'case':<{width}}{'earlier':<9}{'seconds':>8}  result")
    total_start = time.perf_counter()
    for case in cases:
        result, seconds = run_in_subprocess(case.name, timeout_s,
                                            inter_op_threads)
        print(f"{case.name:<{width}}{case.earlier or '-':<9}"
              f"{seconds:8.1f}  {result}", flush=True)
    print(f"total {time.perf_counter() - total_start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES_BY_NAME),
                        help="Run this one case here and print its result.")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="Seconds before a case counts as a hang.")
    parser.add_argument("--select", default="",
                        help="Run only cases whose name contains this.")
    parser.add_argument("--inter-op", type=int, default=0,
                        help="TF inter-op threads per case (0: TF's "
                             "default, one per core).")
    parser.add_argument("--no-combine", action="store_true",
                        help="Turn DTensor's all-reduce combining off in "
                             f"every case ({COMBINE_SWITCH}=0).")
    parser.add_argument("--list", action="store_true",
                        help="Print the case names and exit.")
    args = parser.parse_args()
    if args.no_combine:
        # Read by DTensor when it makes its device; children inherit it.
        os.environ[COMBINE_SWITCH] = "0"
    if args.list:
        print("\n".join(case.name for case in CASES))
    elif args.case:
        print("RESULT " + run_case(args.case, args.inter_op), flush=True)
    else:
        cases = [case for case in CASES if args.select in case.name]
        print_table(cases, args.timeout, args.inter_op)


if __name__ == "__main__":
    main()
