"""Warnings a script must not lose: that it trains as plain Keras.

Why: the brief's first rule is that a script never trains as plain Keras
on one device without being told. Many published scripts silence every
warning (`warnings.filterwarnings("ignore")` at the top: six of
keras.io's, among them the GAT node classifier, whose model trained as
plain Keras without a word), and those filters swallowed the package's
notice with TensorFlow's noise. Such a notice is still a `UserWarning`
where the script's filters let it through (tests and users catch it so),
and goes to stderr, once, where they would hide it.
"""

import sys
import warnings


def must_tell(message: str, stacklevel: int = 2) -> None:
    """`warnings.warn(message)` from the caller's caller (`stacklevel` as
    for `warnings.warn`, counted from the caller), or, where the
    script's filters ignore it, the same line on stderr. A filter that
    turns warnings into errors raises, as it would."""
    with warnings.catch_warnings(record=True) as seen:
        # The script's own filters, unchanged: what they let through is
        # recorded here and shown below through the script's own hook.
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
    if not seen:
        print(f"UserWarning (shown although warnings are filtered): "
              f"{message}", file=sys.stderr, flush=True)
        return
    for each in seen:
        warnings.showwarning(each.message, each.category, each.filename,
                             each.lineno, each.file, each.line)
