"""One side of `python -m flexflow_keras compare`: runs a user's script
and writes what its fits did to a JSON file.

Run as a file, never imported as part of the package, so that the plain
Keras side does not import flexflow_keras (whose import makes virtual
devices):

    python .../flexflow_keras/compare_child.py --impl keras|flexflow_keras
        --out RESULT.json [--seed N] SCRIPT [ARGS...]

With `--impl flexflow_keras` the script's Keras imports are turned into
flexflow_keras ones (`rewrite_imports`: what a user changes by hand),
and nothing else; with `--impl keras` a script written for
flexflow_keras gets Keras's imports back. Both sides seed Python, NumPy and TensorFlow alike
before the script runs. Every `fit` gets one more callback, which
records each epoch's logs and when the first training batch ended; the
result also holds the wall time, the strategy and its simulated figures
(flexflow_keras), the warnings the run raised, and the error that ended
it, if any.
"""

import argparse
import inspect
import json
import os
import re
import sys
import time
import traceback
import warnings

# Each import of Keras in a line of its own, as scripts write them:
# `import keras`, `import keras as k`, `from keras import x`,
# `from keras.layers import x`, `from tensorflow import keras`,
# `import tensorflow.keras as keras`, `from tensorflow.keras import x`.
_TO_OURS = (
    (re.compile(r"^(\s*)import keras(\s*(?:#.*)?)$", re.M),
     r"\1import flexflow_keras as keras\2"),
    (re.compile(r"^(\s*)import keras as (\w+)", re.M),
     r"\1import flexflow_keras as \2"),
    (re.compile(r"^(\s*)from (?:tensorflow\.)?keras((?:\.\w+)*) import ",
                re.M),
     r"\1from flexflow_keras\2 import "),
    (re.compile(r"^(\s*)from tensorflow import keras(\s*(?:#.*)?)$", re.M),
     r"\1import flexflow_keras as keras\2"),
    (re.compile(r"^(\s*)import tensorflow\.keras as (\w+)", re.M),
     r"\1import flexflow_keras as \2"),
)
# And back, for a script written for flexflow_keras (ours in examples/).
_TO_KERAS = (
    (re.compile(r"^(\s*)import flexflow_keras as keras\b", re.M),
     r"\1import keras"),
    (re.compile(r"^(\s*)import flexflow_keras as (\w+)", re.M),
     r"\1import keras as \2"),
    (re.compile(r"^(\s*)from flexflow_keras((?:\.\w+)*) import ", re.M),
     r"\1from keras\2 import "),
    (re.compile(r"^(\s*)import flexflow_keras(\s*(?:#.*)?)$", re.M),
     r"\1import keras as flexflow_keras\2"),
)


def rewrite_imports(source: str, to: str = "flexflow_keras"
                    ) -> tuple[str, int]:
    """`source` with its Keras imports turned into flexflow_keras ones
    (`to="flexflow_keras"`), or its flexflow_keras imports into Keras
    ones (`to="keras"`), and how many lines changed."""
    if to not in ("keras", "flexflow_keras"):
        raise ValueError(
            f"`to` must be 'keras' or 'flexflow_keras'. Received: {to!r}"
        )
    changed = 0
    for pattern, replacement in (_TO_OURS if to == "flexflow_keras"
                                 else _TO_KERAS):
        source, count = pattern.subn(replacement, source)
        changed += count
    return source, changed


class _Recorder:
    """What the script's fits did, filled by a callback added to each."""

    def __init__(self, start: float):
        self.start = start
        self.fits: list[dict] = []
        self.first_step_s: float | None = None

    def callback(self, keras_module, model):
        recorder = self
        # `epoch_s`: each epoch's seconds, validation included (a first
        # epoch holds the tracing and expansion a strategy adds).
        fit = {"model": getattr(model, "name", "?"), "epochs": [],
               "epoch_s": []}
        self.fits.append(fit)
        began = [0.0]

        class Record(keras_module.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                began[0] = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                if recorder.first_step_s is None:
                    recorder.first_step_s = time.perf_counter() - \
                        recorder.start

            def on_epoch_end(self, epoch, logs=None):
                fit["epoch_s"].append(time.perf_counter() - began[0])
                fit["epochs"].append({
                    k: float(v) for k, v in (logs or {}).items()
                    if _is_number(v)
                })

        return Record(), fit


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _patch_fit(recorder: _Recorder) -> None:
    """Every `keras.Model.fit` (flexflow_keras's models call it too)
    runs with the recorder's callback; after it, the strategy."""
    import keras

    original = keras.Model.fit
    signature = inspect.signature(original)

    def fit(self, *args, **kwargs):
        callback, record = recorder.callback(keras, self)
        bound = signature.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        bound.arguments["callbacks"] = callbacks + [callback]
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            record.update(_strategy_of(self))

    keras.Model.fit = fit


def _strategy_of(model) -> dict:
    """The flexflow_keras strategy a model trained under, if any."""
    strategy = getattr(model, "strategy", None)
    if strategy is None or not hasattr(strategy, "to_text"):
        return {}
    found = {
        "strategy": strategy.to_text(),
        "devices": len({d for c in strategy.values() for d in c.device_ids}),
    }
    plan = getattr(model, "plan", None)
    result = getattr(plan, "search_result", None)
    if result is not None:
        found["simulated_ms"] = float(result.best_ms)
        found["data_parallel_ms"] = float(result.data_parallel_ms)
    if plan is not None:
        found["source"] = plan.source
    return found


def main(argv=None) -> int:
    start = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("keras", "flexflow_keras"),
                        required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    script = os.path.abspath(args.script)
    # As `python SCRIPT` would: the script's folder first, not ours.
    sys.path[0] = os.path.dirname(script)
    sys.argv = [script] + args.args
    with open(script) as f:
        source = f.read()
    result = {"impl": args.impl, "script": script, "error": None}
    source, result["imports_changed"] = rewrite_imports(source, args.impl)
    if args.impl == "flexflow_keras":
        import flexflow_keras  # noqa: F401  (devices, before the seed)
    import keras

    keras.utils.set_random_seed(args.seed)
    recorder = _Recorder(start)
    _patch_fit(recorder)
    seen = []
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, *rest):
        text = f"{category.__name__}: {message}"
        if text not in seen:
            seen.append(text)
        show(message, category, filename, lineno, *rest)

    warnings.showwarning = showwarning
    code = compile(source, script, "exec")
    scope = {"__name__": "__main__", "__file__": script}
    status = 0
    try:
        exec(code, scope)
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (
            0 if exit_.code is None else 1)
    except BaseException as error:  # noqa: BLE001 - reported, then exit 1
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"
        status = 1
    result.update(
        wall_s=time.perf_counter() - start,
        first_step_s=recorder.first_step_s,
        fits=recorder.fits,
        warnings=seen,
        status=status,
    )
    with open(args.out, "w") as f:
        json.dump(result, f)
    return status


if __name__ == "__main__":
    sys.exit(main())
