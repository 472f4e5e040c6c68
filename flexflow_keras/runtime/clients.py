"""What DTensor clients (hosts) must agree on, sent over DTensor itself.

In multi-client mode every client runs the same script and must trace
the same functions on the same meshes, so they must train the same graph
under the same strategy. Client 0 plans (its search, its measurements);
`broadcast_text` hands its strategy to the others, and `check_agree`
fails clearly, on every client, when a client built another graph.

The bytes travel as one DTensor collective over a mesh of every device
(a max-reduce of a tensor whose rows only client 0 fills): TensorFlow's
own collectives, no transport of ours.
"""

import functools
import hashlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras import devices
from flexflow_keras import settings as settings_lib
from flexflow_keras.runtime import layouts


class ClientsDisagree(RuntimeError):
    """Clients built different models or strategies."""


def _mesh() -> Any:
    """Every device, on one axis: the runtime's mesh rule
    (`layouts.MeshCache`: this client's devices local, the others'
    remote)."""
    names = devices.device_names()
    return layouts.MeshCache(names, devices.local_device_names()).get(
        (len(names),), tuple(range(len(names)))
    )


def _reduce(values: np.ndarray, reduce: Any, mine: bool) -> np.ndarray:
    """`reduce` (max or min) over clients of an int32 vector of one
    length on all; each client's rows hold `values` if `mine`, else
    zeros."""
    mesh = _mesh()
    layout = dtensor.Layout([mesh.dim_names[0], dtensor.UNSHARDED], mesh)
    row = tf.constant(values if mine else np.zeros_like(values),
                      dtype=tf.int32)[tf.newaxis]
    packed = dtensor.pack([row] * len(mesh.local_devices()), layout)
    return dtensor.unpack(_reducer(reduce, mesh)(packed))[0].numpy()


@functools.lru_cache(maxsize=8)
def _reducer(reduce: Any, mesh: Any) -> Any:
    """One traced function per reduction and mesh, any vector length:
    a function made per call retraces every time (TensorFlow's retracing
    warning on every host)."""

    @tf.function(reduce_retracing=True)
    def reduced(x):
        return dtensor.relayout(
            reduce(x, axis=0), dtensor.Layout.replicated(mesh, 1)
        )

    return reduced


def _from_client_0(values: np.ndarray) -> np.ndarray:
    """Client 0's int32 vector (>= 0), on every client (same length on
    all)."""
    return _reduce(values, tf.reduce_max, devices.client_id() == 0)


def broadcast_text(text: str) -> str:
    """Client 0's `text` on every client (others pass anything)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    length = _from_client_0(np.array([len(data)], dtype=np.int32))[0]
    padded = np.zeros(int(length), dtype=np.int32)
    if devices.client_id() == 0:
        padded[:] = data
    return bytes(_from_client_0(padded).astype(np.uint8)).decode("utf-8")


def fingerprint(text: str) -> str:
    """16 hex digits of the text's SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def check_agree(text: str, what: str) -> None:
    """Raises `ClientsDisagree` on every client when some client's
    `text` differs from the others' (every client must call it, in the
    same order); the message says whether this client's matches
    client 0's."""
    mine = fingerprint(text)
    words = np.frombuffer(bytes.fromhex(mine), dtype=np.uint8).astype(
        np.int32
    )
    high = _reduce(words, tf.reduce_max, True)
    low = _reduce(words, tf.reduce_min, True)
    if np.array_equal(high, low):
        return
    lead = broadcast_text(mine)
    verdict = ("the same as client 0's" if mine == lead
               else f"unlike client 0's ({lead})")
    raise ClientsDisagree(
        f"DTensor clients built different {what}s: client "
        f"{devices.client_id()}'s (fingerprint {mine}) is {verdict}. "
        "Every host must run the same script with the same model, data, "
        "batch size and flags."
    )


def graph_text(graph: Any) -> str:
    """What must be equal in every client's graph: ops, their types,
    inputs and shapes, in order."""
    return "\n".join(
        f"{op.name} {op.type} {op.inputs} {op.input_shapes} "
        f"{op.output_shapes} {sorted(op.partitionable)}"
        for op in graph
    )


def weights_text(weights: list) -> str:
    """A digest of the model's weight values, for `check_agree`."""
    digest = hashlib.sha256()
    for value in weights:
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def agreed_plan(
    make_plan: Callable[[], Any], build_graph: Callable[[], Any],
    num_devices: int, weights: Callable[[], list] = list,
) -> Any:
    """The plan every client trains under: client 0's.

    Client 0 runs `make_plan()` (its search, measurements and exports);
    its strategy reaches every client (`broadcast_text`), each of which
    checks its own graph (`build_graph()`) and weight values
    (`weights()`) against client 0's and reads the strategy for it. A failure on client 0 reaches the others as an
    error too, so that none waits for a collective that never comes.
    """
    from flexflow_keras import planner, strategy_files

    lead = devices.client_id() == 0
    plan, failure, text = None, None, ""
    if lead:
        try:
            plan = make_plan()
        except Exception as e:  # every client must learn of it
            failure, text = e, f"!{type(e).__name__}: {e}"
        else:
            text = plan.strategy.to_text()
    text = broadcast_text(text)
    if text.startswith("!"):
        if failure is not None:
            raise failure
        raise RuntimeError(
            f"DTensor client 0 could not plan the model: {text[1:]}"
        )
    graph = plan.graph if lead else build_graph()
    check_agree(graph_text(graph), "model graph")
    check_agree(weights_text(weights()), "initial weight value")
    if lead:
        return plan
    strategy = strategy_files.complete(
        strategy_files.parse_text(text, "client 0's strategy"), graph,
        num_devices, "client 0's strategy",
    )
    return planner.Plan(graph, strategy, "client 0")


# Callbacks that write files: on one machine, hosts would overwrite each
# other's; on a cluster, every host would write the same checkpoint.
_WRITERS = ("ModelCheckpoint", "BackupAndRestore", "TensorBoard",
            "CSVLogger")


def host_fit_arguments(
    verbose: Any, callbacks: Any, all_hosts: bool = False
) -> tuple[Any, Any]:
    """fit()'s `verbose` and `callbacks` for this client: unchanged on
    client 0 (or alone, or with `all_hosts`: the `all_hosts_output`
    setting); elsewhere no progress bar and no callback that writes
    files (`_WRITERS`), since client 0 already does both."""
    if devices.client_id() == 0 or all_hosts:
        return verbose, callbacks
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        return 0, callbacks  # a CallbackList: the user's own, kept
    kept = [c for c in callbacks or ()
            if type(c).__name__ not in _WRITERS]
    return 0, kept


class HostLost(RuntimeError):
    """A DTensor client stopped answering during training."""


def lost_host(error: BaseException) -> HostLost | None:
    """A `HostLost` naming the client(s) an error of TensorFlow's
    collectives or coordination service points at; None for other
    errors or outside multi-client mode."""
    clients = settings_lib.dtensor_clients()
    if clients is None or not isinstance(error, (
        tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
        tf.errors.AbortedError, tf.errors.CancelledError,
        tf.errors.InternalError,
    )):
        return None
    text = str(error)
    tasks = sorted({int(t) for t in re.findall(r"/task:(\d+)", text)}
                   - {clients.client_id})
    who = (", ".join(f"host {t}" for t in tasks) if tasks
           else "another host")
    first = text.strip().splitlines()[0] if text.strip() else ""
    return HostLost(
        f"DTensor client {clients.client_id} lost contact with {who} "
        f"during training ({type(error).__name__}: {first[:300]}). "
        "Every host stops: restart all of them (from a checkpoint)."
    )
