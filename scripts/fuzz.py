"""Fuzz the server with malformed requests over HTTP and gRPC, seeded and bounded.

    python scripts/fuzz.py --seed 1 --count 3000 --json out/fuzz.json            # guarded, as `make serve` runs
    python scripts/fuzz.py --seed 1 --count 3000 --guard none --json out/fuzz.json # tritonserver's own HTTP port

The script starts its own server (deepfm copied into a temporary repository,
the launcher's TritonServer on free loopback ports) and sends `--count`
requests drawn from the classes in CLASSES: JSON with mutated shapes, data,
datatypes and parameters; binary-tensor bodies whose headers lie about sizes;
huge, zero and negative dimensions; deep nesting; wrong content types and
encodings; oversized bodies; many inputs; odd names; chunked bodies; and the
same over gRPC as raw protobufs. After every request it checks that the server
is live and that a good request on each protocol still gets the answer it got
at the start. A failed check is a crash: its class and request are recorded,
the server is restarted and fuzzing goes on. Prints a summary, writes JSON,
exits 1 if anything crashed. Traffic only ever goes to 127.0.0.1.

The generator (`cases`) and the checker (`Fuzzer`) are used by
tests/test_fuzz.py against the session's server.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import http.client
import json
import logging
import random
import socket
import struct
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

log = logging.getLogger("fuzz")

HOST = "127.0.0.1"  # the only host this fuzzer talks to
TIMEOUT_S = 15.0
NUMPY = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32, "FP64": np.float64, "FP16": np.float16,
         "UINT8": np.uint8, "INT8": np.int8, "BOOL": np.bool_}  # fmt: skip
DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "UINT16", "INT32", "UINT32", "INT64", "UINT64", "FP16", "BF16", "FP32",
             "FP64", "BYTES", "FOO", "", "fp32", "TYPE_FP32", "FP32\x00"]  # fmt: skip
# dimensions that broke servers somewhere: overflow at 31, 32, 63 and 64 bits, zero, negative
ODD_DIMS = [0, -1, -2, -(2**31), -(2**63), 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**40, 2**48, 2**62, 2**63 - 1, 33, 1000, 10**6]
JSON_ODD_DIMS = ODD_DIMS + [2**63, 2**64, 10**30, 1.5, "1", None, True, [1], {}]


@dataclass(frozen=True)
class Model:
    """A model as its config describes it: (name, datatype, dims) per input."""

    name: str
    max_batch_size: int
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        inputs = tuple(
            (t["name"], str(t["data_type"]).removeprefix("TYPE_"), tuple(int(d) for d in t["dims"])) for t in config["input"]
        )
        return cls(config["name"], int(config.get("max_batch_size", 0)), inputs)

    def shape(self, dims: tuple[int, ...], batch: int) -> list[int]:
        return ([batch] if self.max_batch_size else []) + list(dims)

    def arrays(self, batch: int, seed: int) -> list[np.ndarray]:
        """Valid inputs: floats in [0, 1), integer ids 0 (valid in every table)."""
        rng = np.random.default_rng(seed)
        out = []
        for _, datatype, dims in self.inputs:
            shape = self.shape(dims, batch)
            out.append(rng.random(shape).astype(np.float32) if datatype.startswith("FP") else np.zeros(shape, NUMPY[datatype]))
        return out


@dataclass(frozen=True)
class Case:
    """One request: `cls` names its class; `http` = (method, path, headers,
    body, how) with how in {"plain", "chunked", "short"}; `grpc` = a serialized
    ModelInferRequest (or bytes that are not one)."""

    cls: str
    what: str
    http: tuple[str, str, list[tuple[str, str]], bytes, str] | None = None
    grpc: bytes | None = None

    @property
    def protocol(self) -> str:
        return "http" if self.http is not None else "grpc"


# --- the generator -------------------------------------------------------------------------------


def _json_inputs(model: Model, batch: int, rng: random.Random) -> list[dict]:
    inputs = []
    for (name, datatype, dims), array in zip(model.inputs, model.arrays(batch, rng.randrange(1 << 30))):
        inputs.append({"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.ravel().tolist()})
    return inputs


def _post(model: Model, request, headers=None, path=None, how="plain", raw: bytes | None = None) -> tuple:
    body = raw if raw is not None else json.dumps(request, allow_nan=True).encode()
    headers = [("Content-Type", "application/json")] if headers is None else headers
    return ("POST", path or f"/v2/models/{model.name}/infer", headers, body, how)


def _binary(model: Model, rng: random.Random, batch: int = 1) -> tuple[dict, list[bytes]]:
    arrays = model.arrays(batch, rng.randrange(1 << 30))
    header = {"inputs": [
        {"name": name, "shape": list(a.shape), "datatype": datatype, "parameters": {"binary_data_size": a.nbytes}}
        for (name, datatype, _), a in zip(model.inputs, arrays)
    ]}  # fmt: skip
    return header, [a.tobytes() for a in arrays]


def _binary_post(model: Model, header: dict, blobs: list[bytes], header_length=None, path=None, how="plain") -> tuple:
    text = json.dumps(header).encode()
    length = str(len(text)) if header_length is None else str(header_length)
    headers = [("Inference-Header-Content-Length", length), ("Content-Type", "application/octet-stream")]
    return ("POST", path or f"/v2/models/{model.name}/infer", headers, text + b"".join(blobs), how)


def json_shape(model: Model, rng: random.Random) -> Case:
    inputs = _json_inputs(model, rng.choice([1, 2]), rng)
    tensor = rng.choice(inputs)
    mutation = rng.choice(["one dim", "all dims", "extra dims", "fewer dims", "empty", "not a list"])
    if mutation == "one dim":
        tensor["shape"][rng.randrange(len(tensor["shape"]))] = rng.choice(JSON_ODD_DIMS)
    elif mutation == "all dims":
        tensor["shape"] = [rng.choice(ODD_DIMS) for _ in tensor["shape"]]
    elif mutation == "extra dims":
        tensor["shape"] += [rng.choice(ODD_DIMS) for _ in range(rng.randint(1, 6))]
    elif mutation == "fewer dims":
        tensor["shape"] = tensor["shape"][: rng.randrange(len(tensor["shape"]))]
    elif mutation == "empty":
        tensor["shape"] = []
    else:
        tensor["shape"] = rng.choice([None, 5, "1,13", {"0": 1}])
    if rng.random() < 0.3:
        tensor["data"] = tensor["data"][: rng.randint(0, 3)]
    return Case("json shape", f"{mutation}: {tensor['name']} shape {str(tensor['shape'])[:80]}", http=_post(model, {"inputs": inputs}))


def json_data(model: Model, rng: random.Random) -> Case:
    inputs = _json_inputs(model, 1, rng)
    tensor = rng.choice(inputs)
    mutation = rng.choice(["short", "long", "empty", "types", "nested", "huge numbers", "null", "scalar"])
    data = tensor["data"]
    if mutation == "short":
        tensor["data"] = data[: rng.randrange(len(data))]
    elif mutation == "long":
        tensor["data"] = data * rng.randint(2, 40)
    elif mutation == "empty":
        tensor["data"] = []
    elif mutation == "types":
        tensor["data"] = [rng.choice([1, 1.5, "x", None, True, {}, [], "1e999"]) for _ in data]
    elif mutation == "nested":
        tensor["data"] = [[[v]] for v in data]
    elif mutation == "huge numbers":
        tensor["data"] = [rng.choice([1e308, -1e308, 2**63, 2**64, -(2**63) - 1, 10**40, float("nan"), float("inf")]) for _ in data]
    elif mutation == "null":
        tensor["data"] = None
    else:
        tensor["data"] = rng.choice([0, "abc", {"a": 1}])
    return Case("json data", f"{mutation}: {tensor['name']}", http=_post(model, {"inputs": inputs}))


def json_datatype(model: Model, rng: random.Random) -> Case:
    inputs = _json_inputs(model, 1, rng)
    tensor = rng.choice(inputs)
    tensor["datatype"] = rng.choice(DATATYPES + [None, 5])
    if tensor["datatype"] == "BYTES" and rng.random() < 0.5:
        tensor["data"] = ["x" * rng.choice([0, 1, 1000]) for _ in tensor["data"]]
    return Case("json datatype", f"{tensor['name']} as {tensor['datatype']!r}", http=_post(model, {"inputs": inputs}))


def _odd_parameter(rng: random.Random):
    return rng.choice([-1, 0, 2**31, 2**63 - 1, 2**64, -(2**63), "x", "", True, None, [], {}, 1.5, "a" * 10000])


def json_parameters(model: Model, rng: random.Random) -> Case:
    inputs = _json_inputs(model, 1, rng)
    request = {"inputs": inputs}
    where = rng.choice(["request", "input", "output"])
    keys = ["binary_data_size", "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size",
            "classification", "binary_data", "binary_data_output", "sequence_id", "sequence_start", "priority",
            "timeout", "headers", "triton_enable_empty_final_response", "x" * 300]  # fmt: skip
    parameters = {rng.choice(keys): _odd_parameter(rng) for _ in range(rng.randint(1, 3))}
    if where == "request":
        request["parameters"] = parameters if rng.random() < 0.9 else _odd_parameter(rng)
    elif where == "input":
        rng.choice(inputs)["parameters"] = parameters
    else:
        request["outputs"] = [{"name": rng.choice(["probability", "logits", "nope", ""]), "parameters": parameters}]
    if rng.random() < 0.2:
        request["id"] = _odd_parameter(rng)
    return Case("json parameters", f"{where}: {str(parameters)[:80]}", http=_post(model, request))


def binary_lies(model: Model, rng: random.Random) -> Case:
    header, blobs = _binary(model, rng, rng.choice([1, 2]))
    i = rng.randrange(len(blobs))
    tensor = header["inputs"][i]
    mutation = rng.choice(["size bigger", "size smaller", "size huge", "size odd", "shape huge", "data short",
                           "data long", "header length", "json data too"])  # fmt: skip
    header_length = None
    if mutation == "size bigger":
        tensor["parameters"]["binary_data_size"] += rng.choice([1, 8, 4096])
    elif mutation == "size smaller":
        tensor["parameters"]["binary_data_size"] = rng.randrange(tensor["parameters"]["binary_data_size"])
    elif mutation == "size huge":
        tensor["parameters"]["binary_data_size"] = rng.choice([2**31, 2**32, 2**40, 2**63 - 1, 2**64])
    elif mutation == "size odd":
        tensor["parameters"]["binary_data_size"] = rng.choice([-1, -(2**63), "12", None, 1.5])
    elif mutation == "shape huge":
        tensor["shape"][rng.randrange(len(tensor["shape"]))] = rng.choice(ODD_DIMS)
    elif mutation == "data short":
        blobs[i] = blobs[i][: rng.randrange(len(blobs[i]))]
    elif mutation == "data long":
        blobs[i] = blobs[i] * rng.randint(2, 5)
    elif mutation == "header length":
        text_length = len(json.dumps(header))
        header_length = rng.choice([0, -1, 1, text_length - 1, text_length + 1, 10**9, 2**64, "abc", ""])
    else:
        tensor["data"] = [0] * rng.choice([0, 1, 13])
    return Case("binary lies", mutation, http=_binary_post(model, header, blobs, header_length))


def deep_nesting(model: Model, rng: random.Random) -> Case:
    depth = rng.choice([100, 1000, 10_000, 100_000, 1_000_000])
    inputs = _json_inputs(model, 1, rng)
    where = rng.choice(["data", "request", "parameters", "shape"])
    nest = ("[" * depth + "0" + "]" * depth) if rng.random() < 0.7 else ('{"a":' * depth + "0" + "}" * depth)
    if rng.random() < 0.3:  # unbalanced
        nest = nest[: len(nest) // 2 + 1]
    text = json.dumps({"inputs": inputs})
    if where == "data":
        tensor = inputs[0]
        raw = text.replace(json.dumps(tensor["data"]), nest, 1)
    elif where == "request":
        raw = nest
    elif where == "parameters":
        raw = text[:-1] + ', "parameters": {"p": ' + nest + "}}"
    else:
        raw = text.replace(json.dumps(inputs[0]["shape"]), nest, 1)
    endpoint = rng.choice(["infer", "infer", "generate", "generate_stream", "repository"])
    path = "/v2/repository/index" if endpoint == "repository" else f"/v2/models/{model.name}/{endpoint}"
    return Case("deep nesting", f"{endpoint} {where}, depth {depth}", http=_post(model, None, raw=raw.encode(), path=path))


def content_types(model: Model, rng: random.Random) -> Case:
    body = json.dumps({"inputs": _json_inputs(model, 1, rng)}).encode()
    mutation = rng.choice(["content type", "gzip", "deflate", "bad gzip", "gzip bomb", "unknown encoding", "binary as json"])
    headers = [("Content-Type", "application/json")]
    if mutation == "content type":
        headers = [("Content-Type", rng.choice(["text/plain", "multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
                                                "application/json; charset=utf-16", "\x00", "a" * 8000]))]  # fmt: skip
    elif mutation == "gzip":
        headers.append(("Content-Encoding", "gzip"))
        body = gzip.compress(body)
    elif mutation == "deflate":
        headers.append(("Content-Encoding", "deflate"))
        body = zlib.compress(body)
    elif mutation == "bad gzip":
        headers.append(("Content-Encoding", rng.choice(["gzip", "deflate"])))
        body = body[: rng.randint(0, 40)]
    elif mutation == "gzip bomb":  # a small body that inflates to hundreds of MB of JSON
        headers.append(("Content-Encoding", "gzip"))
        body = _bomb(rng.choice([64, 512]))
    elif mutation == "unknown encoding":
        headers.append(("Content-Encoding", rng.choice(["br", "zstd", "gzip, gzip", "x"])))
    else:
        header, blobs = _binary(model, rng)
        body = json.dumps(header).encode() + b"".join(blobs)
    return Case("content type", mutation, http=_post(model, None, headers, raw=body))


@functools.lru_cache(maxsize=None)
def _bomb(mib: int) -> bytes:
    """gzip of a JSON request with `mib` MiB of zeros in its data (about 1000:1),
    built from one compressed block repeated, with the true CRC and length."""
    head, block, tail = b'{"inputs": [{"name": "dense", "shape": [1, 13], "datatype": "FP32", "data": [', b"0," * (1 << 19), b"0]}]}"
    deflate = zlib.compressobj(1, wbits=-15)
    parts = [deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)]
    packed = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)  # the same bytes each time after a full flush
    parts += [packed] * mib
    parts.append(deflate.compress(tail) + deflate.flush())
    crc = zlib.crc32(head)
    for _ in range(mib):
        crc = zlib.crc32(block, crc)
    crc = zlib.crc32(tail, crc)
    size = len(head) + mib * len(block) + len(tail)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"".join(parts) + struct.pack("<II", crc, size & 0xFFFFFFFF)


def oversized(model: Model, rng: random.Random) -> Case:
    size = rng.choice([2 << 20, 24 << 20, 64 << 20])
    mutation = rng.choice(["binary", "json", "length lie", "length huge"])
    if mutation == "binary":
        header = {"inputs": [{"name": n, "shape": model.shape(d, 1), "datatype": t, "parameters": {"binary_data_size": size}}
                             for n, t, d in model.inputs]}  # fmt: skip
        return Case("oversized", f"binary {size >> 20} MiB", http=_binary_post(model, header, [bytes(size)] * len(model.inputs)))
    if mutation == "json":
        raw = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [' + b"0," * (size // 2) + b"0]}]}"
        return Case("oversized", f"json {size >> 20} MiB", http=_post(model, None, raw=raw))
    body = json.dumps({"inputs": _json_inputs(model, 1, rng)}).encode()
    length = len(body) + rng.choice([1, 1000]) if mutation == "length lie" else rng.choice([2**31, 2**63 - 1, 2**64, 10**30])
    headers = [("Content-Type", "application/json"), ("Content-Length", str(length))]
    return Case("oversized", f"{mutation} {length}", http=_post(model, None, headers, raw=body, how="short"))


def many_inputs(model: Model, rng: random.Random) -> Case:
    count = rng.choice([100, 1000, 10_000, 100_000])
    inputs = _json_inputs(model, 1, rng)
    mutation = rng.choice(["copies", "new names", "outputs"])
    head = json.dumps({"inputs": inputs})[:-2].encode()  # without the closing "]}"
    if mutation == "copies":
        extra = b"".join(b"," + json.dumps(inputs[i % len(inputs)]).encode() for i in range(min(count, 1000)))
        extra *= max(1, count // 1000)
        raw = head + extra + b"]}"
    elif mutation == "new names":
        raw = head + b"".join(b',{"name": "in%d", "shape": [1], "datatype": "FP32", "data": [0]}' % i for i in range(count)) + b"]}"
    else:
        raw = head + b'], "outputs": [' + b",".join(b'{"name": "out%d"}' % i for i in range(count)) + b"]}"
    return Case("many inputs", f"{mutation} x{count}", http=_post(model, None, raw=raw))


def odd_names(model: Model, rng: random.Random) -> Case:
    inputs = _json_inputs(model, 1, rng)
    mutation = rng.choice(["model", "version", "input", "duplicate input", "path"])
    path = None
    odd = rng.choice(["", " ", "..", "%2e%2e", "%00", "\u00e9\u4e2d", "a" * 70000, "deepfm%2Fx", "deepfm/..", "-1", "0",
                      "99999999999999999999", "%ff%fe", "deepfm?x=1", "../../etc"])  # fmt: skip
    if mutation == "model":
        path = f"/v2/models/{odd}/infer"
    elif mutation == "version":
        path = f"/v2/models/{model.name}/versions/{odd}/infer"
    elif mutation == "input":
        rng.choice(inputs)["name"] = odd
    elif mutation == "duplicate input":
        inputs.append(dict(rng.choice(inputs)))
    else:
        path = rng.choice([f"//v2/models/{model.name}/infer", f"/v2/models/{model.name}/infer/", f"/v2/models/{model.name}//infer",
                           f"/v2/models/{model.name}/infer?{odd}", f"/v2/models/{model.name}/generate",
                           f"/v2/models/{model.name}/generate_stream", f"/v2/models/{model.name}/INFER", "/v2/../v2/models/x/infer"])  # fmt: skip
    path = None if path is None else path.encode("utf-8").decode("latin-1")
    return Case("odd names", f"{mutation}: {str(path or odd)[:60]}", http=_post(model, {"inputs": inputs}, path=path))


def chunked(model: Model, rng: random.Random) -> Case:
    mutation = rng.choice(["good", "huge shape", "binary", "bad chunk size", "chunk size overflow", "no end"])
    if mutation == "binary":
        header, blobs = _binary(model, rng)
        method, path, headers, body, _ = _binary_post(model, header, blobs)
        return Case("chunked", mutation, http=(method, path, headers, body, "chunked"))
    inputs = _json_inputs(model, 1, rng)
    if mutation == "huge shape":
        inputs[0]["shape"] = [1, rng.choice([2**32, 2**40])]
    body = json.dumps({"inputs": inputs}).encode()
    how = {"bad chunk size": "chunked-bad", "chunk size overflow": "chunked-overflow", "no end": "chunked-noend"}.get(mutation, "chunked")
    return Case("chunked", mutation, http=_post(model, None, raw=body, how=how))


# --- gRPC ----------------------------------------------------------------------------------------


def _grpc_request(model: Model, rng: random.Random, batch: int = 1) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model.name)
    for (name, datatype, _), array in zip(model.inputs, model.arrays(batch, rng.randrange(1 << 30))):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


def _typed_contents(tensor, values: int) -> None:
    """Data in the typed `contents` fields instead of raw bytes."""
    field_name = {"FP32": "fp32_contents", "INT64": "int64_contents", "INT32": "int_contents", "FP64": "fp64_contents",
                  "BOOL": "bool_contents", "BYTES": "bytes_contents", "UINT8": "uint_contents"}.get(tensor.datatype, "fp32_contents")  # fmt: skip
    getattr(tensor.contents, field_name).extend([b"x"] * values if field_name == "bytes_contents" else [0] * values)


GRPC_DIMS = [d for d in ODD_DIMS if -(2**63) <= d < 2**63]


def grpc_case(model: Model, rng: random.Random) -> Case:
    request = _grpc_request(model, rng, rng.choice([1, 2]))
    i = rng.randrange(len(request.inputs))
    tensor = request.inputs[i]
    mutation = rng.choice(["shape", "shape with typed contents", "typed contents", "datatype", "raw short", "raw long",
                           "raw count", "parameters", "outputs", "many inputs", "odd names", "not a protobuf"])  # fmt: skip
    if mutation == "shape":
        del tensor.shape[:]
        tensor.shape.extend([rng.choice(GRPC_DIMS) for _ in range(rng.randint(0, 6))])
    elif mutation in ("shape with typed contents", "typed contents"):
        del request.raw_input_contents[:]
        for t in request.inputs:
            _typed_contents(t, int(np.prod(t.shape)) if mutation == "typed contents" else rng.choice([0, 1, 13]))
        if mutation == "shape with typed contents":
            tensor.shape[rng.randrange(len(tensor.shape))] = rng.choice(GRPC_DIMS)
    elif mutation == "datatype":
        tensor.datatype = rng.choice(DATATYPES)
    elif mutation == "raw short":
        request.raw_input_contents[i] = request.raw_input_contents[i][: rng.randrange(len(request.raw_input_contents[i]))]
    elif mutation == "raw long":
        request.raw_input_contents[i] = request.raw_input_contents[i] * rng.randint(2, 5)
    elif mutation == "raw count":
        if rng.random() < 0.5:
            del request.raw_input_contents[rng.randrange(len(request.raw_input_contents))]
        else:
            request.raw_input_contents.extend([b"\0" * 8] * rng.randint(1, 100))
    elif mutation == "parameters":
        target = rng.choice([request.parameters, tensor.parameters])
        key = rng.choice(["binary_data_size", "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size",
                          "sequence_id", "priority", "timeout", "classification", "x" * 300])  # fmt: skip
        kind = rng.choice(["int64_param", "string_param", "bool_param", "double_param", "uint64_param"])
        value = {"int64_param": rng.choice([-1, 2**63 - 1, -(2**63), 0]), "string_param": rng.choice(["", "x" * 5000, "\u00e9"]),
                 "bool_param": True, "double_param": rng.choice([float("nan"), 1e308, -1.0]), "uint64_param": 2**64 - 1}[kind]  # fmt: skip
        setattr(target[key], kind, value)
    elif mutation == "outputs":
        output = request.outputs.add()
        output.name = rng.choice(["probability", "logits", "nope", ""])
        setattr(output.parameters["classification"], "int64_param", rng.choice([-1, 0, 1, 2**31, 2**63 - 1]))
    elif mutation == "many inputs":
        for n in range(rng.choice([100, 1000, 10_000])):
            extra = request.inputs.add()
            extra.name, extra.datatype = f"in{n}", "FP32"
            extra.shape.append(1)
            request.raw_input_contents.append(b"\0" * 4)
    elif mutation == "odd names":
        odd = rng.choice(["", "\u00e9", "a" * 70000, "../x", "\x00"])
        if rng.random() < 0.5:
            request.model_name = odd
        else:
            tensor.name = odd
        if rng.random() < 0.3:
            request.model_version = rng.choice(["-1", "99999999999999999999", "x"])
    else:
        return Case("grpc", mutation, grpc=bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))))
    return Case("grpc", f"{mutation}: {tensor.name[:40]} {list(tensor.shape)}", grpc=request.SerializeToString())


CLASSES: dict[str, Callable[[Model, random.Random], Case]] = {
    "json shape": json_shape,
    "json data": json_data,
    "json datatype": json_datatype,
    "json parameters": json_parameters,
    "binary lies": binary_lies,
    "deep nesting": deep_nesting,
    "content type": content_types,
    "oversized": oversized,
    "many inputs": many_inputs,
    "odd names": odd_names,
    "chunked": chunked,
    "grpc": grpc_case,
}
# the slow classes (tens of MB per request) are drawn less often
WEIGHTS = {"oversized": 0.2, "many inputs": 0.5, "deep nesting": 0.5, "grpc": 4.0}


def cases(model: Model, seed: int, count: int) -> Iterator[Case]:
    """`count` cases, the same for the same seed."""
    rng = random.Random(seed)
    names = list(CLASSES)
    weights = [WEIGHTS.get(n, 1.0) for n in names]
    for _ in range(count):
        yield CLASSES[rng.choices(names, weights)[0]](model, rng)


# --- sending and checking --------------------------------------------------------------------------


def _chunks(body: bytes, how: str) -> bytes:
    parts = [body[i : i + 997] for i in range(0, len(body), 997)] or [b""]
    out = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts)
    if how == "chunked-bad":
        return b"zz\r\n" + out
    if how == "chunked-overflow":
        return b"ffffffffffffffffffff\r\n" + body[:10]
    if how == "chunked-noend":
        return out
    return out + b"0\r\n\r\n"


def send_http(port: int, case: Case, timeout_s: float = TIMEOUT_S) -> str:
    """The response's status, or what happened to the connection."""
    method, path, headers, body, how = case.http
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{port}", "Connection: close"]
    names = {k.lower() for k, _ in headers}
    lines += [f"{k}: {v}" for k, v in headers]
    if how.startswith("chunked"):
        lines.append("Transfer-Encoding: chunked")
        payload = _chunks(body, how)
    else:
        if "content-length" not in names:
            lines.append(f"Content-Length: {len(body)}")
        payload = body
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="replace") + payload
    with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(raw)
            if how in ("short", "chunked-noend"):
                sock.shutdown(socket.SHUT_WR)  # the server sees the end of a body that lied about its length
        except OSError as error:
            return f"send: {type(error).__name__}"
        response = http.client.HTTPResponse(sock, method=method)
        try:
            response.begin()
            response.read()
            return str(response.status)
        except socket.timeout:
            return "timeout"
        except (OSError, http.client.HTTPException) as error:
            return f"recv: {type(error).__name__}"


def model_config(http_port: int, model: str) -> dict:
    """The model's config, from the server's HTTP API."""
    connection = http.client.HTTPConnection(HOST, http_port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", f"/v2/models/{model}/config")
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


class Fuzzer:
    """Sends cases to a server on 127.0.0.1 and checks it after each one."""

    def __init__(self, http_port: int, grpc_port: int, model: Model):
        self.http_port, self.grpc_port, self.model = http_port, grpc_port, model
        self.channel = grpc.insecure_channel(
            f"{HOST}:{grpc_port}", options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.good_arrays = model.arrays(1, seed=0)
        self.expected: np.ndarray | None = None

    def close(self) -> None:
        self.channel.close()

    def send(self, case: Case) -> str:
        if case.http is not None:
            try:
                return send_http(self.http_port, case)
            except OSError as error:
                return f"connect: {type(error).__name__}"
        if case.what == "not a protobuf":
            raw = self.channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            call = lambda: raw(case.grpc, timeout=TIMEOUT_S)  # noqa: E731
        else:
            request = service_pb2.ModelInferRequest.FromString(case.grpc)
            call = lambda: self.stub.ModelInfer(request, timeout=TIMEOUT_S)  # noqa: E731
        try:
            call()
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    # a good request, both ways

    def good_http(self) -> np.ndarray:
        inputs = [{"name": n, "shape": list(a.shape), "datatype": t, "data": a.ravel().tolist()}
                  for (n, t, _), a in zip(self.model.inputs, self.good_arrays)]  # fmt: skip
        connection = http.client.HTTPConnection(HOST, self.http_port, timeout=TIMEOUT_S)
        try:
            connection.request("POST", f"/v2/models/{self.model.name}/infer", json.dumps({"inputs": inputs}))
            response = connection.getresponse()
            body = json.loads(response.read())
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {body}")
        output = body["outputs"][0]
        return np.asarray(output["data"], np.float32).reshape(output["shape"])

    def good_grpc(self) -> np.ndarray:
        request = service_pb2.ModelInferRequest(model_name=self.model.name)
        for (name, datatype, _), array in zip(self.model.inputs, self.good_arrays):
            tensor = request.inputs.add()
            tensor.name, tensor.datatype = name, datatype
            tensor.shape.extend(array.shape)
            request.raw_input_contents.append(array.tobytes())
        response = self.stub.ModelInfer(request, timeout=TIMEOUT_S)
        return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(response.outputs[0].shape))

    def healthy(self) -> str | None:
        """None if the server is live and both good requests get the expected
        answer, else what is wrong."""
        try:
            connection = http.client.HTTPConnection(HOST, self.http_port, timeout=TIMEOUT_S)
            connection.request("GET", "/v2/health/live")
            status = connection.getresponse().status
            connection.close()
            if status != 200:
                return f"/v2/health/live answered {status}"
            self.stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=TIMEOUT_S)
            answers = [self.good_http(), self.good_grpc()]
        except (OSError, RuntimeError, ValueError, grpc.RpcError, http.client.HTTPException) as error:
            return f"{type(error).__name__}: {str(error)[:300]}"
        if self.expected is None:
            self.expected = answers[0]
        for answer in answers:
            if answer.shape != self.expected.shape or not np.allclose(answer, self.expected, rtol=1e-5, atol=1e-6):
                return f"wrong answer {answer.ravel()[:4]} (expected {self.expected.ravel()[:4]})"
        return None


@dataclass
class Report:
    """What one run found."""

    sent: Counter = field(default_factory=Counter)  # by class
    outcomes: Counter = field(default_factory=Counter)  # (class, status)
    crashes: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "sent": dict(self.sent),
            "total": sum(self.sent.values()),
            "outcomes": {f"{c} -> {s}": n for (c, s), n in sorted(self.outcomes.items())},
            "crashes": self.crashes,
            "crash_classes": dict(Counter(c["class"] for c in self.crashes)),
            "seconds": round(self.seconds, 1),
        }


def run(
    fuzzer: Fuzzer, seed: int, count: int, budget_s: float = 1e9, on_crash: Callable[[dict], bool] | None = None
) -> Report:
    """Send `count` cases (stop early after `budget_s`); after a crash, go on
    only if `on_crash(crash)` (which may restart the server and add to the
    crash's record) says so."""
    report = Report()
    start = time.monotonic()
    problem = fuzzer.healthy()
    if problem is not None:
        raise RuntimeError(f"the server is not healthy before fuzzing: {problem}")
    for index, case in enumerate(cases(fuzzer.model, seed, count)):
        if time.monotonic() - start > budget_s:
            break
        outcome = fuzzer.send(case)
        report.sent[case.cls] += 1
        report.outcomes[(case.cls, outcome)] += 1
        problem = fuzzer.healthy()
        if problem is not None:
            crash = {"index": index, "class": case.cls, "what": case.what, "protocol": case.protocol, "outcome": outcome, "check": problem}
            log.error("crash after case %d (%s: %s): %s", index, case.cls, case.what, problem)
            report.crashes.append(crash)
            if on_crash is None or not on_crash(crash):
                break
    report.seconds = time.monotonic() - start
    return report


# --- the long run: its own server ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from opara_core.serving.launcher import GUARDS, REPO_ROOT, ServerConfig, TritonServer, describe_exit, free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds at most")
    parser.add_argument("--model", default="deepfm", help="a model of model_repository/ to serve and fuzz")
    parser.add_argument("--guard", choices=GUARDS, default="python", help="what serves the HTTP port in front of tritonserver (none: fuzz its own)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="opara-fuzz-") as tmp:
        repository = Path(tmp) / "models"
        source = REPO_ROOT / "model_repository" / args.model
        (repository / args.model / "1").mkdir(parents=True)
        (repository / args.model / "config.pbtxt").write_text((source / "config.pbtxt").read_text())
        (repository / args.model / "1" / "model.py").write_text((source / "1" / "model.py").read_text())
        config = ServerConfig(repository, free_port(), free_port(), free_port(), exit_timeout_s=5, guard=args.guard)
        server = TritonServer(config, Path(tmp) / "server.log")
        server.start()
        server.wait_ready()

        def restart(crash: dict) -> bool:
            server.stop()
            crash["server"] = f"{describe_exit(server.returncode)}{server.last_words()}"
            log.info("tritonserver %s; restarting", crash["server"])
            server.start()
            server.wait_ready()
            return True

        try:
            model = Model.from_config(model_config(config.http_port, args.model))
            fuzzer = Fuzzer(config.http_port, config.grpc_port, model)
            try:
                report = run(fuzzer, args.seed, args.count, args.budget, on_crash=restart)
            finally:
                fuzzer.close()
        finally:
            server.stop()
    result = {"seed": args.seed, "count": args.count, "model": args.model, "guard": args.guard, **report.to_json()}
    print(json.dumps({k: result[k] for k in ("total", "seconds", "crash_classes", "sent")}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if report.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
