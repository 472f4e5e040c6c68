"""Search and device settings: compile kwargs > command line > env > default.

The only module that reads `sys.argv` and `os.environ`. It is named
`settings` because `flexflow_keras.config` must stay Keras's own
`keras.config`.

Our flags are taken out of `sys.argv` once, at import, so that a script's
own `argparse` (which rejects unknown flags) or absl flags never see them;
the script's own flags are left untouched and in order.
"""

import dataclasses
import os
import sys
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

ENV_PREFIX = "FLEXFLOW_KERAS_"


@dataclasses.dataclass(frozen=True)
class _Flag:
    field: str
    names: tuple[str, ...]
    parse: Any


def _int(value: str) -> int:
    return int(value)


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


_FLAGS = (
    _Flag("search_budget", ("--search-budget", "--budget"), _int),
    _Flag("search_alpha", ("--search-alpha", "--alpha"), float),
    _Flag("search_seed", ("--search-seed", "--seed"), _int),
    _Flag("search_verbose", ("--search-verbose",), _int),
    _Flag("export_strategy", ("--export-strategy", "--export"), str),
    _Flag("import_strategy", ("--import-strategy", "--import"), str),
    _Flag("machine", ("--machine",), str),
    _Flag("cpu_devices", ("--cpu-devices",), _int),
    _Flag("all_hosts_output", ("--all-hosts-output",), _bool),
)
_BY_NAME = {name: flag for flag in _FLAGS for name in flag.names}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved settings of one `compile()`.

    Args:
        search_budget: MCMC iterations; 0 keeps data parallelism.
        search_alpha: FlexFlow's MCMC temperature factor, per ms; None
            (default): the search's rule on the relative change
            (`search.RELATIVE_ALPHA`).
        search_seed: Seed of the search; None draws one.
        search_verbose: 0 silent; 1 (default) a Keras progress bar and
            the chosen strategy; 2 FlexFlow's lines every 100 iterations
            instead of the bar.
        export_strategy: Path to write the chosen strategy to (in a
            folder that exists: checked here, before the search).
        import_strategy: Path of a strategy to use instead of searching.
        machine: Preset name or JSON spec path of the machine to plan
            for; None means the attached devices.
        cpu_devices: Virtual CPU devices to create at import.
        all_hosts_output: In DTensor's multi-client mode, every host
            prints progress and runs the callbacks that write files;
            False (default): host 0 alone does.
    """

    search_budget: int = 1000
    search_alpha: float | None = None
    search_seed: int | None = None
    search_verbose: int = 1
    export_strategy: str | None = None
    import_strategy: str | None = None
    machine: str | None = None
    cpu_devices: int | None = None
    all_hosts_output: bool = False

    def __post_init__(self):
        if self.search_budget < 0:
            raise ValueError(
                "`search_budget` must be >= 0 (0 keeps data parallelism). "
                f"Received: search_budget={self.search_budget}"
            )
        if self.search_alpha is not None and self.search_alpha < 0:
            raise ValueError(
                "`search_alpha` must be >= 0. "
                f"Received: search_alpha={self.search_alpha}"
            )
        if self.search_verbose not in (0, 1, 2):
            raise ValueError(
                "`search_verbose` must be 0 (silent), 1 (progress bar) or "
                "2 (FlexFlow's lines). Received: "
                f"search_verbose={self.search_verbose}"
            )
        if self.export_strategy:
            _check_export_path(self.export_strategy)
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise ValueError(
                "`--cpu-devices` must be a positive integer. "
                f"Received: cpu_devices={self.cpu_devices}"
            )


def _check_export_path(path: str) -> None:
    """Raises unless `path` can be written as a file: checked before the
    search, which would otherwise run to its end and then fail to save."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(
            "`export_strategy` must name a file, not a folder. Received: "
            f"export_strategy={path!r}. Name a file in it, e.g. "
            f"{os.path.join(path, 'strategy.txt')!r}."
        )
    if not os.path.isdir(folder):
        raise ValueError(
            f"`export_strategy` names a file in a folder that does not "
            f"exist ({folder!r}). Received: export_strategy={path!r}. "
            "Create the folder first, or name a file in one that exists."
        )


FIELDS = tuple(f.name for f in dataclasses.fields(Settings))


def take_flags(argv: MutableSequence[str]) -> dict[str, Any]:
    """Removes our flags from `argv` in place; returns their values.

    Accepts `--flag value` and `--flag=value`. Everything else stays.
    """
    found: dict[str, Any] = {}
    kept = [argv[0]] if argv else []
    i = 1
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        flag = _BY_NAME.get(name)
        if flag is None:
            kept.append(arg)
            i += 1
            continue
        if eq:
            raw, i = inline, i + 1
        elif i + 1 < len(argv):
            raw, i = argv[i + 1], i + 2
        else:
            raise ValueError(
                f"Flag `{name}` needs a value. Received: {' '.join(argv)}"
            )
        found[flag.field] = _parse(flag, name, raw)
    argv[:] = kept
    return found


def _parse(flag: _Flag, source: str, raw: str) -> Any:
    try:
        return flag.parse(raw)
    except ValueError:
        raise ValueError(
            f"`{source}` expects a {flag.parse.__name__.strip('_')} value. "
            f"Received: {raw!r}"
        ) from None


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings given as `FLEXFLOW_KERAS_<FIELD>` variables."""
    found = {}
    for flag in _FLAGS:
        key = ENV_PREFIX + flag.field.upper()
        if environ.get(key, "") != "":
            found[flag.field] = _parse(flag, key, environ[key])
    return found


# Taken once at import, before the user's script parses its own flags.
_COMMAND_LINE: Mapping[str, Any] = dict(take_flags(sys.argv))


def command_line() -> dict[str, Any]:
    """The package's flags taken from this process's command line."""
    return dict(_COMMAND_LINE)


@dataclasses.dataclass(frozen=True)
class Clients:
    """This process's place among DTensor clients (multi-client mode).

    Args:
        client_id: This client, 0..num_clients-1 (`DTENSOR_CLIENT_ID`).
        num_clients: Clients in all (`DTENSOR_JOBS` entries).
        job_name: `DTENSOR_JOB_NAME`.
    """

    client_id: int
    num_clients: int
    job_name: str


def dtensor_clients(
    environ: Mapping[str, str] | None = None,
) -> Clients | None:
    """The DTensor multi-client setup of this process, or None when it
    runs alone (no `DTENSOR_JOBS`, or one job).

    Raises:
        ValueError: When the variables disagree (a client id outside the
            jobs, a `DTENSOR_NUM_CLIENTS` other than the jobs' count).
    """
    env = os.environ if environ is None else environ
    jobs = [j for j in env.get("DTENSOR_JOBS", "").split(",") if j]
    if len(jobs) <= 1:
        return None
    raw_id = env.get("DTENSOR_CLIENT_ID", "")
    try:
        client_id = int(raw_id)
    except ValueError:
        client_id = -1
    if not 0 <= client_id < len(jobs):
        raise ValueError(
            f"DTENSOR_CLIENT_ID must be an integer in 0..{len(jobs) - 1} "
            f"(one per DTENSOR_JOBS entry). Received: {raw_id!r}"
        )
    count = env.get("DTENSOR_NUM_CLIENTS", "")
    if count and count != str(len(jobs)):
        raise ValueError(
            f"DTENSOR_NUM_CLIENTS={count} but DTENSOR_JOBS lists "
            f"{len(jobs)} clients. Make them agree."
        )
    return Clients(client_id, len(jobs),
                   env.get("DTENSOR_JOB_NAME", "") or "worker")


# How long a DTensor client waits at import for the others to join.
DEFAULT_JOIN_TIMEOUT_S = 300.0


def join_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """`FLEXFLOW_KERAS_JOIN_TIMEOUT_S`, or `DEFAULT_JOIN_TIMEOUT_S`."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_PREFIX + "JOIN_TIMEOUT_S", "")
    if raw == "":
        return DEFAULT_JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"{ENV_PREFIX}JOIN_TIMEOUT_S must be a number of seconds > 0. "
            f"Received: {raw!r}"
        )
    return value


def show_layouts(environ: Mapping[str, str] | None = None) -> bool:
    """`FLEXFLOW_KERAS_SHOW_LAYOUTS` (1/0, true/false; default off): print
    the layouts each op really ran with at a strategy's first train step
    (`runtime/realized.py`)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_PREFIX + "SHOW_LAYOUTS", "")
    if raw == "":
        return False
    try:
        return _bool(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_PREFIX}SHOW_LAYOUTS must be 1 or 0 (true/false, yes/no, "
            f"on/off). Received: {raw!r}"
        ) from None


# TensorFlow's C++ log level we start with: 1 hides INFO lines (DTensor
# prints two per SPMD expansion, `dtensor_device.cc ... cache key lookup
# missed`), keeps warnings and errors.
NATIVE_LOG_LEVEL = "1"


def quiet_native_logs(environ: MutableMapping[str, str] | None = None,
                      loaded: bool | None = None) -> None:
    """Sets `TF_CPP_MIN_LOG_LEVEL` to `NATIVE_LOG_LEVEL` unless the user
    set it (theirs wins). TensorFlow reads it once, when it loads: this
    runs at our import, usually before TensorFlow's. Where TensorFlow is
    `loaded` already (default: whether `tensorflow` is imported; a script
    that imports it first), its threshold is lowered in place
    (`native_log_level`)."""
    env = os.environ if environ is None else environ
    if "TF_CPP_MIN_LOG_LEVEL" in env:
        return
    env["TF_CPP_MIN_LOG_LEVEL"] = NATIVE_LOG_LEVEL
    if loaded is None:
        loaded = "tensorflow" in sys.modules
    if loaded:
        from flexflow_keras import native_log_level
        native_log_level.set_min_log_level(int(NATIVE_LOG_LEVEL))


# DTensor's switch for relayouts by all-to-all collectives. On TensorFlow
# 2.21 they give wrong values, with no error, where a mesh axis moves
# between two dims of a rank-4 tensor neither of which is the batch dim
# (docs/RUNTIME.md, "Relayouts"); off, DTensor relays out by all-gather
# and slice, right in every case measured.
ALL_TO_ALL_RELAYOUT = "DTENSOR_USE_ALL_TO_ALL_RELAYOUT"


def all_gather_relayouts(environ: MutableMapping[str, str] | None = None
                         ) -> None:
    """Turns DTensor's all-to-all relayouts off unless the user set the
    switch (theirs wins). DTensor reads it once, at its first relayout
    in the process: this runs at our import, before any."""
    env = os.environ if environ is None else environ
    env.setdefault(ALL_TO_ALL_RELAYOUT, "0")


# DTensor's switch for its pass that merges independent all-reduces into
# one (`dtensor_passes.py` chooses its value per process).
COMBINE_ALL_REDUCES = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def combine_all_reduces(default: bool,
                        environ: MutableMapping[str, str] | None = None
                        ) -> bool:
    """Sets DTensor's all-reduce combining to `default` unless the user
    set it (theirs wins); returns whether combining is on."""
    env = os.environ if environ is None else environ
    env.setdefault(COMBINE_ALL_REDUCES, "1" if default else "0")
    return env[COMBINE_ALL_REDUCES] != "0"


def resolve(
    kwargs: Mapping[str, Any] | None = None,
    command_line: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Settings with precedence kwargs > command line > environment.

    Args:
        kwargs: Values passed to `compile()`; None entries are unset.
        command_line: Parsed flags; defaults to those taken at import.
        environ: Environment; defaults to `os.environ`.
    """
    merged = from_environment(os.environ if environ is None else environ)
    merged.update(_COMMAND_LINE if command_line is None else command_line)
    for key, value in (kwargs or {}).items():
        if key not in FIELDS:
            raise TypeError(
                f"Unknown flexflow_keras setting `{key}`. "
                f"Expected one of: {', '.join(FIELDS)}"
            )
        if value is not None:
            merged[key] = value
    return Settings(**merged)
