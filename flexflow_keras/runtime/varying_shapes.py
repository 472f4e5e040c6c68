"""Which traced step runs a batch whose lengths change from batch to
batch: one step for all lengths where DTensor allows it.

Why: text padded to each batch's longest (`padded_batch`, a
`TextVectorization` without `output_sequence_length`) gives most
batches a length of their own. A step traced for each would pay a trace
and an SPMD expansion per length (seconds each), and a step's
tf.function called on a new length traced itself again outside
`ModelStepExecutor._trace` (its captures not laid on the mesh, its
loops' names refused by DTensor: TensorFlow's RNN text-classification
tutorial crashed). Keras's own train function does what this module
does: traced on the first shapes, then once more with the dims that
changed left unknown (`tf.function(reduce_retracing=True)`).

A step that needs static shapes (DTensor's recurrent loops,
`rolled_rnn`, and steps traced with the batch size written in), and a
batch whose small inputs go in padded (`variables.padded`: their shapes
are Python values of the trace), get one trace per length, up to
`MAX_STATIC_LENGTHS` per family of batches; past that the model trains
as plain Keras, saying why (`TooManyLengths`), rather than trace
without end.

A key is `(kind, batch size, structure, signature, padded shapes)`:
`signature` holds each leaf's dims beyond the batch and dtype; a
relaxed key has None where batches differed.
"""

from typing import Any

from flexflow_keras.runtime.variables import SMALL_INPUT_ELEMENTS

# Static traces one family of batches (one kind, batch size, structure
# and ranks) may take before its model trains as plain Keras.
MAX_STATIC_LENGTHS = 8


class TooManyLengths(Exception):
    """Batches of more shapes than `MAX_STATIC_LENGTHS` in a family whose
    steps take one shape each."""


def _family(key: tuple) -> tuple:
    """What batches that only differ in their lengths share."""
    kind, size, structure, signature, padded = key
    ranks = tuple(
        (len(entry[0]), entry[1]) if isinstance(entry, tuple) else entry
        for entry in signature)
    return (kind, size, structure, ranks,
            tuple(None if shape is None else len(shape) for shape in padded))


def _covers(general: tuple, signature: tuple) -> bool:
    """Whether a trace of `general` takes a batch of `signature`."""
    for wide, entry in zip(general, signature):
        if not isinstance(wide, tuple):
            continue
        if any(w is not None and w != d for w, d in zip(wide[0], entry[0])):
            return False
    return True


def _relaxed(general: tuple, signature: tuple) -> tuple:
    """`general` with None where `signature` differs."""
    return tuple(
        (tuple(w if w == d else None for w, d in zip(wide[0], entry[0])),
         wide[1]) if isinstance(wide, tuple) else wide
        for wide, entry in zip(general, signature))


class Signatures:
    """The keys a model's steps were traced for, per family."""

    def __init__(self):
        self._general: dict[tuple, tuple] = {}  # family -> widest key
        self._static: dict[tuple, set] = {}  # family -> static keys

    def key_for(self, key: tuple, traced: Any, static: bool) -> tuple:
        """The key of the step that runs a batch of `key`: `key` itself
        where that step exists or the batch is its family's first, else
        the family's relaxed key (traced with its None dims unknown).

        Args:
            key: The batch's exact key.
            traced: The keys of the steps traced so far.
            static: Whether steps need static shapes.

        Raises:
            TooManyLengths: each step of the family takes one shape
                (`static`, or padded inputs), and it has had
                `MAX_STATIC_LENGTHS` shapes already.
        """
        if key in traced:
            return key
        family = _family(key)
        general = self._general.get(family)
        if general is None:
            self._general[family] = key
            self._static[family] = {key}
            return key
        if static or general[4] != key[4]:
            # One step per shape: a padded input's shape is a Python
            # value of its trace.
            lengths = self._static[family]
            lengths.add(key)  # a key traced again (a retry) counts once
            if len(lengths) > MAX_STATIC_LENGTHS:
                raise TooManyLengths(
                    f"its batches came in more than {MAX_STATIC_LENGTHS} "
                    "shapes (a length padded to each batch's longest), "
                    "and its step is traced anew for each (TensorFlow's "
                    "DTensor runs recurrent layers as loops of a fixed "
                    "length; inputs of fewer than "
                    f"{SMALL_INPUT_ELEMENTS} values go in at their exact "
                    "shape). Pad every batch to one length "
                    "(`TextVectorization(output_sequence_length=...)`, "
                    "`keras.utils.pad_sequences(maxlen=...)`, "
                    "`padded_batch(padded_shapes=...)`) to train under "
                    "the strategy")
            return key
        if _covers(general[3], key[3]) and general in traced:
            return general
        wider = general[:3] + (_relaxed(general[3], key[3]),) + general[4:]
        self._general[family] = wider
        return wider

    @staticmethod
    def dims(key: tuple) -> tuple:
        """Per leaf, the dims beyond the batch to trace `key`'s step
        with (None: unknown), or None for a leaf without a shape."""
        return tuple(entry[0] if isinstance(entry, tuple) else None
                     for entry in key[3])
