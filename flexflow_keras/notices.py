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

import contextlib
import re
import sys
import warnings
from typing import Iterator


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


@contextlib.contextmanager
def ignoring(*messages: str,
             category: type[Warning] = Warning) -> Iterator[None]:
    """Warnings of `category` whose text starts with one of `messages`
    (regular expressions, as for `warnings.filterwarnings`; none: every
    one) ignored inside the block, the script's own warnings left as
    plain Keras leaves them.

    Why not `warnings.catch_warnings()`: entering and leaving it tells
    Python the filters changed, which empties every module's record of
    the warnings it has shown, so each "once per place" warning of
    Keras's is shown again after it. A script fitting six models on a
    `tf.data.Dataset` (Deep Learning with Python's weather chapter) saw
    Keras's `shuffle=True` warning six times, plain Keras once. An
    "ignore" filter put at the front of the list and taken out again
    does not reset those records, and an ignored warning is not recorded
    as shown, so the user still sees it where plain Keras shows it."""
    added = [("ignore", re.compile(text, re.I) if text else None,
              category, None, 0) for text in (messages or ("",))]
    for entry in added:
        warnings.filters.insert(0, entry)
    try:
        yield
    finally:
        # By identity: a user's filter can equal ours.
        warnings.filters[:] = [
            entry for entry in warnings.filters
            if not any(entry is ours for ours in added)]
