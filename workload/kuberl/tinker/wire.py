"""The Tinker API's binary bodies: a forward/backward request in, its output and a sample's out.

The ``tinker`` SDK sends ``POST /api/v1/forward_backward`` as protocol buffers
(``Content-Type: application/x-protobuf``) and asks for a forward/backward output and a sample response
the same way (``Accept: application/x-protobuf``, it refuses them as JSON); every other body is JSON
(:mod:`.schema`). This module declares the messages those three bodies use — our own declaration of
the public wire format, by field number and type, built in code into a private descriptor pool (no
``protoc``, no clash with the SDK's own module when both are imported) — and converts them to and
from plain Python and NumPy values.

Tensors travel as raw little-endian bytes: a ``Tensor`` is dense bytes or sparse CSR (values, row
pointers, column indices, in the dtype and shape it states); token ids are int32 bytes; an output's
per-datum arrays are one ``BatchedTensor`` per field: every datum's bytes concatenated, with
``offsets[i]`` the byte where datum i starts (n + 1 int64 offsets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

FLOAT32, INT64, INT32 = 1, 2, 3  # the DType enum's values (0: unspecified, 4: bfloat16)
NUMPY_DTYPE = {FLOAT32: np.dtype("<f4"), INT64: np.dtype("<i8"), INT32: np.dtype("<i4")}
STOP, LENGTH = 0, 1  # the StopReason enum

_T = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _T.TYPE_STRING, "bytes": _T.TYPE_BYTES, "int32": _T.TYPE_INT32, "int64": _T.TYPE_INT64,
            "uint32": _T.TYPE_UINT32, "double": _T.TYPE_DOUBLE, "bool": _T.TYPE_BOOL}
PACKAGE = "kuberl.tinker.wire"

# message → [(field, number, type, repeated, oneof)]; type: a scalar above, or another message's name.
# A map<string, V> is a repeated nested "<Name>Entry" message with key = 1, value = 2 (as protoc makes it).
MESSAGES: dict[str, list[tuple[str, int, str, bool, str | None]]] = {
    "SparseCsr": [("values", 1, "bytes", False, None), ("crow_indices", 2, "bytes", False, None),
                  ("col_indices", 3, "bytes", False, None)],
    "Tensor": [("dense", 1, "bytes", False, "encoding"), ("sparse_csr", 2, "SparseCsr", False, "encoding"),
               ("dtype", 3, "dtype", False, None), ("shape", 4, "int64", True, None)],
    "EncodedTextChunk": [("tokens", 1, "bytes", False, None)],
    "Chunk": [("encoded_text", 1, "EncodedTextChunk", False, "chunk"), ("image", 2, "bytes", False, "chunk"),
              ("dmel", 3, "bytes", False, "chunk")],
    "Datum": [("model_input", 1, "Chunk", True, None), ("loss_fn_inputs", 2, "Datum.LossFnInputsEntry", True, None)],
    "Datum.LossFnInputsEntry": [("key", 1, "string", False, None), ("value", 2, "Tensor", False, None)],
    "LossConfigValue": [("number", 1, "double", False, "value"), ("text", 2, "string", False, "value")],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", False, None), ("seq_id", 2, "int32", False, None),
        ("data", 3, "Datum", True, None), ("loss_fn", 4, "string", False, None),
        ("loss_fn_config", 5, "ForwardBackwardRequest.LossFnConfigEntry", True, None),
        ("forward_only", 6, "bool", False, None),
        ("loss_fn_config_v2", 7, "ForwardBackwardRequest.LossFnConfigV2Entry", True, None)],
    "ForwardBackwardRequest.LossFnConfigEntry": [("key", 1, "string", False, None),
                                                 ("value", 2, "double", False, None)],
    "ForwardBackwardRequest.LossFnConfigV2Entry": [("key", 1, "string", False, None),
                                                   ("value", 2, "LossConfigValue", False, None)],
    "BatchedTensor": [("data", 1, "bytes", False, None), ("offsets", 2, "bytes", False, None),
                      ("dtype", 3, "dtype", False, None), ("trailing_shape", 4, "int64", True, None)],
    "ArrayRecord": [("type_tag", 1, "string", False, None), ("fields", 2, "ArrayRecord.FieldsEntry", True, None),
                    ("num_datums", 3, "int64", False, None)],
    "ArrayRecord.FieldsEntry": [("key", 1, "string", False, None), ("value", 2, "BatchedTensor", False, None)],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, "string", False, None),
                              ("loss_fn_outputs", 2, "ArrayRecord", True, None),
                              ("metrics", 3, "ForwardBackwardOutput.MetricsEntry", True, None)],
    "ForwardBackwardOutput.MetricsEntry": [("key", 1, "string", False, None), ("value", 2, "double", False, None)],
    "TopkLogprobs": [("token_ids", 1, "bytes", False, None), ("logprobs", 2, "bytes", False, None),
                     ("k", 3, "uint32", False, None), ("length", 4, "uint32", False, None)],
    "SampledSequence": [("stop_reason", 1, "stop_reason", False, None), ("tokens", 2, "bytes", False, None),
                        ("logprobs", 3, "bytes", False, "_logprobs")],
    "SampleResponse": [("sequences", 1, "SampledSequence", True, None),
                       ("prompt_logprobs", 2, "bytes", False, "_prompt_logprobs"),
                       ("prompt_cache_hit_tokens", 4, "int32", False, None)],
}
ENUMS = {"DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
         "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"]}
SYNTHETIC_ONEOFS = {"_logprobs", "_prompt_logprobs"}  # proto3 ``optional``: presence, not a choice


def _field(message: descriptor_pb2.DescriptorProto, spec: tuple[str, int, str, bool, str | None]) -> None:
    name, number, kind, repeated, oneof = spec
    f = message.field.add(name=name, number=number, label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL)
    if kind in ("dtype", "stop_reason"):
        f.type, f.type_name = _T.TYPE_ENUM, f".{PACKAGE}.{'DType' if kind == 'dtype' else 'StopReason'}"
    elif kind in _SCALARS:
        f.type = _SCALARS[kind]
    else:
        f.type, f.type_name = _T.TYPE_MESSAGE, f".{PACKAGE}.{kind}"
    if oneof is not None:
        names = [o.name for o in message.oneof_decl]
        if oneof not in names:
            message.oneof_decl.add(name=oneof)
            names.append(oneof)
        f.oneof_index = names.index(oneof)
        f.proto3_optional = oneof in SYNTHETIC_ONEOFS


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name="kuberl_tinker_wire.proto", package=PACKAGE, syntax="proto3")
    for enum, values in ENUMS.items():
        proto.enum_type.add(name=enum, value=[descriptor_pb2.EnumValueDescriptorProto(name=v, number=i)
                                              for i, v in enumerate(values)])
    made: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name, fields in MESSAGES.items():  # parents come before their entries
        parent, _, entry = name.rpartition(".")
        message = made[parent].nested_type.add(name=entry) if parent else proto.message_type.add(name=name)
        if parent:
            message.options.map_entry = True
        for spec in fields:
            _field(message, spec)
        made[name] = message
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ForwardBackwardRequestMessage = _message("ForwardBackwardRequest")
ForwardBackwardOutputMessage = _message("ForwardBackwardOutput")
SampleResponseMessage = _message("SampleResponse")


class WireError(ValueError):
    """A body that is not what the Tinker API sends; the message says which part."""


@dataclass
class DatumIn:
    """One datum of a forward/backward request: its tokens and its loss inputs by name."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    data: list[DatumIn]
    config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def _array(tensor: Any, where: str) -> np.ndarray:
    dtype = NUMPY_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {tensor.dtype} is not float32, int64 or int32")
    shape = [int(s) for s in tensor.shape]
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        if len(shape) != 2:
            raise WireError(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype="<i8")
        cols = np.frombuffer(csr.col_indices, dtype="<i8")
        fits = len(rows) == shape[0] + 1 and len(cols) == len(values) and rows[0] == 0 and rows[-1] == len(cols)
        if not fits or (len(cols) and (cols.min() < 0 or cols.max() >= shape[1])) or bool((np.diff(rows) < 0).any()):
            raise WireError(f"{where}: sparse CSR indices do not fit shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            lo, hi = int(rows[row]), int(rows[row + 1])
            dense[row, cols[lo:hi]] = values[lo:hi]
        return dense
    flat = np.frombuffer(tensor.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != flat.size:
        raise WireError(f"{where}: {flat.size} values do not fill shape {shape}")
    return flat.reshape(shape) if shape else flat


def _tokens(datum: Any, index: int) -> list[int]:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data[{index}].model_input: {kind or 'empty'} chunks are not served (text tokens only)")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist()
    return tokens


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A ``ForwardBackwardRequest`` body as plain values; WireError when it does not parse."""
    message = ForwardBackwardRequestMessage()
    try:
        message.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError and friends
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest: {err}") from err
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():  # the newer map wins where both are set
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = [DatumIn(_tokens(datum, i), {name: _array(t, f"data[{i}].loss_fn_inputs.{name}")
                                        for name, t in datum.loss_fn_inputs.items()})
            for i, datum in enumerate(message.data)]
    return ForwardBackwardCall(message.model_id, int(message.seq_id), message.loss_fn, data, config,
                               bool(message.forward_only))


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one record, each field's per-datum float32 arrays batched; metrics by name."""
    message = ForwardBackwardOutputMessage(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(out[name], dtype="<f4") for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8")
        record.fields[name].CopyFrom(record.fields[name].__class__(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=FLOAT32,
            trailing_shape=list(arrays[0].shape[1:]) if arrays else []))
    return message.SerializeToString()


@dataclass
class SequenceOut:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # False: it ran out of length


def encode_sample_response(sequences: list[SequenceOut], prompt_logprobs: list[float] | None) -> bytes:
    """``SampleResponse``: int32 tokens and float32 log-probs per sequence; prompt log-probs (NaN where
    none, i.e. the first token) when asked for."""
    message = SampleResponseMessage()
    for seq in sequences:
        message.sequences.add(stop_reason=STOP if seq.stopped else LENGTH,
                              tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
                              logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes())
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return message.SerializeToString()
