"""Strategy files: FlexFlow's protobuf (`.pb`) and its printed text (`.txt`).

The binary form uses FlexFlow's `strategy.proto` schema (package
`FFProtoBuf`), so FlexFlow and flexflow_keras read each other's files.
There is no `protoc` here; the message classes are built at import from a
`FileDescriptorProto`, which works on protobuf 4.25 through 7.

A plain protobuf cannot tell a file cut between two ops from a shorter
file, nor a flipped digit from a different strategy. So ours start with a
header that FlexFlow's reader skips as unknown fields: fields 15 and 16 of
`Strategy`, the op count and a CRC-32 of the ops. A file whose header
disagrees with its ops is reported as truncated or corrupt; a file
without it (written by FlexFlow) is read as is. The text form states
its op count in a first `# flexflow_keras strategy: N ops` comment line
(no checksum: people edit text files).

Reading validates against the model and the machine and names the
offending op; ops missing from a file take data parallelism, with one
warning listing them.
"""

import os
import re
import warnings
import zlib

from google.protobuf import descriptor_pb2, descriptor_pool, message
from google.protobuf import message_factory

from flexflow_keras.graph import OpGraph
from flexflow_keras.strategy import (
    ParallelConfig,
    Strategy,
    check_known_ops,
    data_parallel_config,
    validate_config,
)

_HEADER_FIELD = 15
_TEXT_HEADER = re.compile(r"^#\s*flexflow_keras strategy:\s*(\d+) ops?\s*$")
_TEXT_LINE = re.compile(
    r"^\[(?P<name>.+)\]\s+num_dims\((?P<num_dims>\d+)\)\s+"
    r"dims\[(?P<dims>[\d,\s]*)\]\s+device_ids\[(?P<ids>[\d,\s]*)\]\s*$"
)
BINARY_EXTENSIONS = (".pb", ".bin", ".proto")
TEXT_EXTENSIONS = (".txt", ".strategy", ".pbtxt")


def _build_classes() -> tuple[type, type, type]:
    """FFProtoBuf.Op / .Strategy, and our header view of the same bytes."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="flexflow_keras/ffprotobuf_strategy.proto",
        package="FFProtoBuf",
        syntax="proto2",
    )
    label = descriptor_pb2.FieldDescriptorProto
    for name, values in (("DeviceType", ("GPU", "CPU")),
                         ("MemoryType", ("FBM", "ZCM"))):
        enum = proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    op = proto.message_type.add(name="Op")
    op.field.add(name="name", number=1, label=label.LABEL_REQUIRED,
                 type=label.TYPE_STRING)
    op.field.add(name="device_type", number=2, label=label.LABEL_REQUIRED,
                 type=label.TYPE_ENUM, type_name=".FFProtoBuf.DeviceType",
                 default_value="GPU")
    op.field.add(name="dims", number=3, label=label.LABEL_REPEATED,
                 type=label.TYPE_INT32)
    op.field.add(name="device_ids", number=4, label=label.LABEL_REPEATED,
                 type=label.TYPE_INT32)
    op.field.add(name="memory_types", number=5, label=label.LABEL_REPEATED,
                 type=label.TYPE_ENUM, type_name=".FFProtoBuf.MemoryType")
    strategy = proto.message_type.add(name="Strategy")
    strategy.field.add(name="ops", number=1, label=label.LABEL_REPEATED,
                       type=label.TYPE_MESSAGE, type_name=".FFProtoBuf.Op")
    # FFProtoBuf.Strategy plus our header fields: how we read the bytes.
    header = proto.message_type.add(name="FlexFlowKerasStrategy")
    header.field.add(name="ops", number=1, label=label.LABEL_REPEATED,
                     type=label.TYPE_MESSAGE, type_name=".FFProtoBuf.Op")
    header.field.add(name="num_ops", number=_HEADER_FIELD,
                     label=label.LABEL_OPTIONAL, type=label.TYPE_UINT32)
    header.field.add(name="crc32", number=_HEADER_FIELD + 1,
                     label=label.LABEL_OPTIONAL, type=label.TYPE_FIXED32)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(proto.SerializeToString())
    get = message_factory.GetMessageClass
    return tuple(
        get(pool.FindMessageTypeByName(f"FFProtoBuf.{name}"))
        for name in ("Op", "Strategy", "FlexFlowKerasStrategy")
    )


OpProto, StrategyProto, _ReadProto = _build_classes()


def _is_binary(path: str) -> bool:
    ext = os.path.splitext(str(path))[1].lower()
    if ext in BINARY_EXTENSIONS:
        return True
    if ext in TEXT_EXTENSIONS:
        return False
    raise ValueError(
        "Cannot tell the strategy file format from its extension. "
        f"Received: path={str(path)!r}. Use {', '.join(BINARY_EXTENSIONS)} "
        f"for FlexFlow's protobuf or {', '.join(TEXT_EXTENSIONS)} for text."
    )


def to_bytes(strategy: Strategy, device_type: str = "GPU") -> bytes:
    """The protobuf bytes of `strategy`, header first."""
    body = StrategyProto()
    for name, config in strategy.items():
        body.ops.add(
            name=name,
            device_type=device_type,
            dims=config.dims,
            device_ids=config.device_ids,
        )
    data = body.SerializeToString()
    header = _ReadProto(num_ops=len(strategy), crc32=zlib.crc32(data))
    return header.SerializeToString() + data


def to_text(strategy: Strategy) -> str:
    """The text form: a count line, then FlexFlow's one line per op."""
    return (
        f"# flexflow_keras strategy: {len(strategy)} ops\n"
        + strategy.to_text()
    )


def save_strategy(strategy: Strategy, path: str) -> None:
    """Writes `strategy` to `path`; `.pb` binary, `.txt` text.

    Args:
        strategy: The strategy.
        path: Destination; the extension picks the format.
    """
    if _is_binary(path):
        with open(path, "wb") as f:
            f.write(to_bytes(strategy))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_text(strategy))


def _config(
    where: str, name: str, dims: list[int], ids: list[int]
) -> ParallelConfig:
    try:
        return ParallelConfig(tuple(dims), tuple(ids))
    except ValueError as e:
        raise ValueError(f"{where}: op '{name}': {e}") from None


def parse_bytes(data: bytes, where: str = "<bytes>") -> dict:
    """Op name -> config from protobuf bytes; raises on corrupt input."""
    proto = _ReadProto()
    try:
        proto.ParseFromString(data)
    except (message.DecodeError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{where} is not a valid FlexFlow strategy protobuf (corrupt "
            f"or truncated): {e}. Re-export it, or use the text form."
        ) from None
    if not proto.IsInitialized():
        raise ValueError(
            f"{where} is not a complete FlexFlow strategy protobuf: "
            f"missing {proto.FindInitializationErrors()}."
        )
    ops_only = StrategyProto()
    ops_only.ops.extend(proto.ops)
    body = ops_only.SerializeToString()
    known = _ReadProto(ops=proto.ops)
    if proto.HasField("num_ops"):
        known.num_ops = proto.num_ops
    if proto.HasField("crc32"):
        known.crc32 = proto.crc32
    if len(known.SerializeToString()) != len(data):
        # Bytes no field of the schema claims: a damaged tag or header.
        raise ValueError(
            f"{where} is corrupt: it holds fields outside FlexFlow's "
            "strategy schema. Re-export it."
        )
    if proto.HasField("num_ops") and proto.num_ops != len(proto.ops):
        raise ValueError(
            f"{where} is truncated: its header promises {proto.num_ops} "
            f"ops, it holds {len(proto.ops)}. Re-export it."
        )
    if proto.HasField("crc32") and zlib.crc32(body) != proto.crc32:
        raise ValueError(
            f"{where} is corrupt: its checksum does not match its ops. "
            "Re-export it."
        )
    configs: dict[str, ParallelConfig] = {}
    for op in proto.ops:
        if op.name in configs:
            raise ValueError(f"{where}: op '{op.name}' appears twice.")
        configs[op.name] = _config(
            where, op.name, list(op.dims), list(op.device_ids)
        )
    return configs


def parse_text(text: str, where: str = "<text>") -> dict:
    """Op name -> config from the text form; raises on bad lines."""
    configs: dict[str, ParallelConfig] = {}
    promised = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        head = _TEXT_HEADER.match(line.strip())
        if head:
            promised = int(head.group(1))
            continue
        if line.lstrip().startswith("#"):
            continue
        match = _TEXT_LINE.match(line.strip())
        if not match:
            raise ValueError(
                f"{where} line {number} is not a strategy line. Received: "
                f"{line!r}. Expected e.g. '[dense_1] num_dims(2) dims[4,1] "
                "device_ids[0,1,2,3]'."
            )
        name = match.group("name")
        dims = [int(x) for x in match.group("dims").split(",") if x.strip()]
        ids = [int(x) for x in match.group("ids").split(",") if x.strip()]
        if int(match.group("num_dims")) != len(dims):
            raise ValueError(
                f"{where} line {number}: op '{name}' says num_dims("
                f"{match.group('num_dims')}) but lists {len(dims)} dims."
            )
        if name in configs:
            raise ValueError(f"{where}: op '{name}' appears twice.")
        configs[name] = _config(f"{where} line {number}", name, dims, ids)
    if promised is not None and promised != len(configs):
        raise ValueError(
            f"{where} is truncated: its header promises {promised} ops, it "
            f"holds {len(configs)}. Re-export it."
        )
    return configs


def read_configs(path: str) -> dict:
    """Op name -> config as written in the file, not yet validated."""
    where = f"Strategy file {str(path)!r}"
    binary = _is_binary(path)
    if binary:
        with open(path, "rb") as f:
            return parse_bytes(f.read(), where)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(
            f"{where} is not UTF-8 text. A binary protobuf needs the `.pb` "
            "extension."
        ) from None
    return parse_text(text, where)


def complete(
    configs: dict, graph: OpGraph, num_devices: int, where: str
) -> Strategy:
    """A validated strategy from file configs; missing ops get data
    parallelism (`data_parallel_config`, valid for any batch) with one
    warning that lists them."""
    if not configs:
        raise ValueError(
            f"{where} holds no ops. Received an empty strategy; export one "
            "with `save_strategy` or `python -m flexflow_keras search`."
        )
    check_known_ops(configs, graph, where)
    for op in graph:
        config = configs.get(op.name)
        if config is not None:
            try:
                validate_config(op, config, num_devices)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    missing = [op.name for op in graph if op.name not in configs]
    if missing:
        warnings.warn(
            f"{where} has no config for {len(missing)} ops; they take "
            f"data parallelism: {missing}",
            stacklevel=3,
        )
    full = {
        op.name: configs.get(op.name) or data_parallel_config(op, num_devices)
        for op in graph
    }
    return Strategy(full)


def load_strategy(path: str, graph: OpGraph, num_devices: int) -> Strategy:
    """Reads and validates a strategy file for `graph` on a machine.

    Args:
        path: A `.pb` (FlexFlow protobuf) or `.txt` (text) file.
        graph: The model's `OpGraph`.
        num_devices: Devices of the machine (ids 0..n-1).

    Returns:
        A `Strategy` with a config for every op of `graph`.

    Raises:
        ValueError: Unreadable, corrupt or truncated file; ops the model
            lacks; a config the op cannot take or devices the machine
            lacks. The message names the file and the op.
    """
    where = f"Strategy file {str(path)!r}"
    if not os.path.isfile(path):
        raise ValueError(
            f"{where} does not exist. Received: path={str(path)!r}"
        )
    return complete(read_configs(path), graph, num_devices, where)
