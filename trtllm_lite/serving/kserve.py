"""KServe v2 ``inference.GRPCInferenceService`` with the TensorRT-LLM ensemble's tensors.

A client written for TensorRT-LLM on Triton (``tritonclient.grpc``, model ``ensemble``)
works unchanged: ``text_input`` / ``max_tokens`` / ``stream``... in, ``text_output`` out
(table and conversion in :mod:`trtllm_lite.ensemble_tensors`). The protocol's messages
come from ``tritonclient``'s generated stubs (``service_pb2``), the same ones its clients use.

* ``ModelInfer``: one response with the whole text; ``stream=true`` is refused
  (INVALID_ARGUMENT), as Triton refuses plain inference on a decoupled model.
* ``ModelStreamInfer`` (decoupled): many requests over one bidirectional stream; per
  request one response per new piece of text (``stream=true``) or one at the end. Every
  response carries the parameter ``triton_final_response``, true on the request's last
  one; with ``triton_enable_empty_final_response`` the end is a separate empty response.
  Errors come back as ``error_message`` for that request only. Cancelling the stream
  aborts its requests.
"""
from __future__ import annotations

import asyncio
import math
import uuid
from contextlib import ExitStack, aclosing

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from .. import __version__
from .. import ensemble_tensors as et
from .engine_service import Accumulator, EngineService, classify, position_logprobs

#: Model names a request may use: ours (the served name) and TensorRT-LLM's.
TRTLLM_MODEL_NAMES = ("ensemble", "tensorrt_llm_bls")
SERVICE_NAME = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
          "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


MAX_DIMS = 64   # an input tensor's dimensions at most (numpy's limit)


class NotFoundError(LookupError):
    """The request names a model this server does not serve."""


def input_arrays(request: kpb.ModelInferRequest) -> dict[str, np.ndarray]:
    """Decode a request's input tensors (``raw_input_contents`` or typed ``contents``).

    Raises:
        ValueError: unknown datatype, a datatype other than the ensemble table's for that
            tensor (as Triton checks against ``config.pbtxt``), duplicate name, or data that
            does not fill the shape.
    """
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ValueError(f"{len(request.inputs)} input tensors but {len(raw)} raw_input_contents")
    arrays = {}
    for i, t in enumerate(request.inputs):
        if t.name in arrays:
            raise ValueError(f"input tensor {t.name!r} is given twice")
        if t.datatype not in _CONTENTS:
            raise ValueError(f"input tensor {t.name!r}: unknown datatype {t.datatype!r}")
        spec = et.INPUTS_BY_NAME.get(t.name)     # unknown names: parse_inputs names them
        if spec is not None and t.datatype != spec.datatype:
            raise ValueError(f"input tensor {t.name!r} must be {spec.datatype}, got {t.datatype}")
        shape = tuple(int(d) for d in t.shape)
        if len(shape) > MAX_DIMS:   # (numpy's own message named no tensor; QA 24)
            raise ValueError(f"input tensor {t.name!r}: shape has {len(shape)} dimensions, more than {MAX_DIMS}")
        if any(d < 0 for d in shape):
            raise ValueError(f"input tensor {t.name!r}: negative dimension in shape {list(shape)}")
        count = math.prod(shape)   # (Python ints: numpy's int64 product wraps past 2^63, to 0 here)
        if raw and t.datatype == "BYTES":
            try:
                arr = et.deserialize_bytes_tensor(raw[i], shape)
            except ValueError as e:
                raise ValueError(f"input tensor {t.name!r}: {e}") from None
        elif raw:
            dtype = np.dtype(_NUMPY[t.datatype]).newbyteorder("<")
            if len(raw[i]) != count * dtype.itemsize:
                raise ValueError(f"input tensor {t.name!r}: {len(raw[i])} bytes do not fill shape "
                                 f"{list(shape)} of {t.datatype}")
            arr = np.frombuffer(raw[i], dtype=dtype).reshape(shape)
        else:
            values = list(getattr(t.contents, _CONTENTS[t.datatype]))
            if len(values) != count:
                raise ValueError(f"input tensor {t.name!r}: {len(values)} values do not fill shape {list(shape)}")
            if t.datatype == "BYTES":
                arr = np.empty(count, dtype=object)
                arr[:] = values
                arr = arr.reshape(shape)
            else:
                arr = np.array(values, dtype=_NUMPY[t.datatype]).reshape(shape)
        arrays[t.name] = arr
    return arrays


def infer_response(request: kpb.ModelInferRequest, outputs: dict[str, np.ndarray], final: bool | None = None
                   ) -> kpb.ModelInferResponse:
    """A ``ModelInferResponse`` echoing the request's model and id, with ``outputs`` in
    ``raw_output_contents`` (only those the request asked for, if it named any)."""
    wanted = [o.name for o in request.outputs] or list(outputs)
    resp = kpb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version or "1",
                                  id=request.id)
    for name in wanted:
        if name not in outputs:
            continue
        spec = et.OUTPUTS_BY_NAME[name]
        array = outputs[name]
        resp.outputs.add(name=name, datatype=spec.datatype, shape=list(array.shape))
        if spec.datatype == "BYTES":
            resp.raw_output_contents.append(et.serialize_bytes_tensor(array))
        else:
            resp.raw_output_contents.append(np.ascontiguousarray(array, dtype=np.dtype(array.dtype).newbyteorder("<"))
                                            .tobytes())
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp


def _times_ns(acc: Accumulator) -> dict[str, int]:
    m = acc.last.metrics if acc.last else None
    if m is None:
        return {}
    pairs = (("arrival_time_ns", m.arrival_time), ("first_scheduled_time_ns", m.first_scheduled_time),
             ("first_token_time_ns", m.first_token_time), ("last_token_time_ns", m.finished_time))
    return {k: int(v * 1e9) for k, v in pairs if v is not None}


class KServeServicer(kpb_grpc.GRPCInferenceServiceServicer):
    """KServe v2 over an :class:`EngineService`; unimplemented RPCs (statistics, repository,
    shared memory, trace, log settings) answer UNIMPLEMENTED."""

    def __init__(self, service: EngineService, stream_buffer: int = 256):
        self.service = service
        self.model_names = (service.model_name,) + tuple(n for n in TRTLLM_MODEL_NAMES if n != service.model_name)
        self.stream_buffer = stream_buffer

    # -- health and metadata --------------------------------------------------------------
    async def ServerLive(self, request, context):
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kpb.ServerReadyResponse(ready=self.service.llm.accepting)

    async def ServerMetadata(self, request, context):
        return kpb.ServerMetadataResponse(name="trtllm-lite", version=__version__, extensions=[])

    async def ModelReady(self, request, context):
        ok = request.name in self.model_names and request.version in ("", "1")
        return kpb.ModelReadyResponse(ready=ok and self.service.llm.accepting)

    async def _model(self, request, context) -> str:
        if request.name not in self.model_names or request.version not in ("", "1"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r} version "
                                f"{request.version!r}; served: {', '.join(self.model_names)} (version 1)")
        return request.name

    async def ModelMetadata(self, request, context):
        name = await self._model(request, context)
        meta = kpb.ModelMetadataResponse.TensorMetadata
        return kpb.ModelMetadataResponse(
            name=name, versions=["1"], platform="trtllm-lite",
            inputs=[meta(name=t.name, datatype=t.datatype, shape=[-1, *t.dims]) for t in et.INPUTS],
            outputs=[meta(name=t.name, datatype=t.datatype, shape=[-1, *t.dims]) for t in et.OUTPUTS])

    async def ModelConfig(self, request, context):
        name = await self._model(request, context)
        dt = mc.DataType.Value
        config = mc.ModelConfig(
            name=name, platform="trtllm-lite", backend="trtllm-lite", max_batch_size=1,
            input=[mc.ModelInput(name=t.name, data_type=dt(et.CONFIG_DATA_TYPE[t.datatype]), dims=list(t.dims),
                                 optional=t.optional) for t in et.INPUTS],
            output=[mc.ModelOutput(name=t.name, data_type=dt(et.CONFIG_DATA_TYPE[t.datatype]), dims=list(t.dims))
                    for t in et.OUTPUTS],
            model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True))
        return kpb.ModelConfigResponse(config=config)

    # -- inference ------------------------------------------------------------------------
    async def _parse(self, request: kpb.ModelInferRequest, timeout: float | None, held: ExitStack,
                     infer: bool = False):
        """The request's ``EnsembleRequest``, ``SamplingParams`` and ``Admission``: taken by the
        engine first (``AsyncLLM.admit``, held by ``held``: a drain waits for it from here),
        then read on the tokenizing threads (its text tensors are tokenized); ``infer``: for
        ModelInfer, which refuses ``stream=true``. A refused request counts in the request
        outcomes (an unknown model as ``invalid_argument``), as the other front ends count
        theirs; one cancelled or past its deadline (``timeout`` s) meanwhile too
        (EngineService.prepare)."""
        try:
            admission = held.enter_context(self.service.llm.admit())
            # its size in bytes stands for its tokenizing's (a BYTES tensor holds 4 more a string)
            ereq, params = await self.service.prepare(self._read, request, timeout=timeout, size=request.ByteSize(),
                                                      admission=admission)
            if infer and ereq.stream:
                raise ValueError("stream=true needs ModelStreamInfer (decoupled); "
                                 "ModelInfer returns the whole text at once")
        except Exception as e:
            self.service.metrics.record_failed("invalid_argument" if isinstance(e, NotFoundError)
                                               else classify(e).name.lower())
            raise
        return ereq, params, admission

    def _read(self, request: kpb.ModelInferRequest):
        if request.model_name not in self.model_names or request.model_version not in ("", "1"):
            raise NotFoundError(f"unknown model {request.model_name!r} version {request.model_version!r}; "
                                f"served: {', '.join(self.model_names)}")
        unknown = [o.name for o in request.outputs if o.name not in et.OUTPUTS_BY_NAME]
        if unknown:
            raise ValueError(f"unknown output tensor {unknown[0]!r}")
        tok = self.service.llm.tokenizer
        ereq = et.parse_inputs(input_arrays(request),
                               encode=(lambda s: tok.encode(s, add_special_tokens=False)) if tok else None,
                               check_words=self.service.llm.engine.check_words_length)
        return ereq, self.service.sampling_params(ereq.sampling)

    def _outputs(self, ereq, acc: Accumulator, texts, token_logprobs=None):
        return et.make_outputs(ereq, texts, num_input_tokens=acc.num_prompt_tokens,
                               num_output_tokens=acc.num_completion_tokens, token_logprobs=token_logprobs,
                               times_ns=_times_ns(acc))

    async def ModelInfer(self, request, context):
        try:
            with ExitStack() as held:
                ereq, params, admission = await self._parse(request, context.time_remaining(), held, infer=True)
                acc = await self.service.generate_all(ereq.prompt, params, uuid.uuid4().hex,
                                                      context.time_remaining(), cache_salt=ereq.cache_salt,
                                                      admission=admission)
        except NotFoundError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except Exception as e:  # noqa: BLE001 - every request error becomes a status
            await context.abort(grpc.StatusCode[classify(e).name], _message(e))
        results = acc.results()
        logprobs = _token_logprobs(results[0]) if ereq.return_log_probs else None
        return infer_response(request, self._outputs(ereq, acc, [s.text for s in results], logprobs))

    async def _stream_one(self, request, timeout: float | None = None):
        """Responses of one request of a stream (``ModelStreamInferResponse``); ``timeout``:
        seconds left of the stream's deadline when the request came (None: none)."""
        with ExitStack() as held:   # the admission: a drain waits for the request from its arrival
            ereq, params, admission = await self._parse(request, timeout, held)
            empty_final = request.parameters["triton_enable_empty_final_response"].bool_param \
                if "triton_enable_empty_final_response" in request.parameters else False
            acc = Accumulator()
            async with aclosing(self.service.generate(ereq.prompt, params, uuid.uuid4().hex, timeout,
                                                      cache_salt=ereq.cache_salt, admission=admission)) as gen:
                async for out in gen:
                    acc.add(out)
                    if not ereq.stream:
                        continue
                    last = out.finished and not empty_final
                    for i, o in enumerate(out.outputs):
                        is_last = last and i == len(out.outputs) - 1
                        if not o.text and not is_last:
                            continue
                        lps = _token_logprobs(o) if ereq.return_log_probs else None
                        outputs = self._outputs(ereq, acc, o.text, lps)
                        if params.n > 1:   # TensorRT-LLM's: the sequences' deltas interleave (QA)
                            outputs["sequence_index"] = et.sequence_index_tensor(ereq, o.index)
                        yield infer_response(request, outputs, is_last)
            if not ereq.stream:
                results = acc.results()
                lps = _token_logprobs(results[0]) if ereq.return_log_probs else None
                yield infer_response(request, self._outputs(ereq, acc, [s.text for s in results], lps),
                                     not empty_final)
            if empty_final:
                yield infer_response(request, {}, True)

    async def ModelStreamInfer(self, request_iterator, context):
        responses: asyncio.Queue = asyncio.Queue(self.stream_buffer)
        request_done, reader_done = object(), object()
        tasks: set[asyncio.Task] = set()
        count = {"started": 0, "finished": 0}

        async def run(request, timeout):
            try:
                async for resp in self._stream_one(request, timeout):
                    await responses.put(kpb.ModelStreamInferResponse(infer_response=resp))
            except Exception as e:  # noqa: BLE001 - this request fails, the stream goes on
                err = kpb.ModelInferResponse(model_name=request.model_name, id=request.id)
                await responses.put(kpb.ModelStreamInferResponse(error_message=_message(e),
                                                                 infer_response=err))
            finally:
                await responses.put(request_done)

        async def read():
            try:
                async for request in request_iterator:
                    count["started"] += 1
                    task = asyncio.create_task(run(request, context.time_remaining()))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                await responses.put(reader_done)

        reader = asyncio.create_task(read())
        reading = True
        try:
            while reading or count["finished"] < count["started"]:
                item = await responses.get()
                if item is request_done:
                    count["finished"] += 1
                elif item is reader_done:
                    reading = False
                else:
                    yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def _unimplemented(name: str):
    async def rpc(self, request, context):
        # the generated base class raises NotImplementedError, which grpc answers UNIMPLEMENTED but
        # also logs at ERROR with a traceback on every call (perf_analyzer asks ModelStatistics)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by trtllm-lite")
    rpc.__name__ = rpc.__qualname__ = name
    return rpc


for _name in ("ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
              "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
              "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
              "TraceSetting", "LogSettings"):
    setattr(KServeServicer, _name, _unimplemented(_name))


def _message(error: BaseException) -> str:
    """A request error's text; a validation error of a sampling field names the tensor that
    set it (``num_return_sequences``, not ``n``; ``end_id``, not ``stop_token_ids``)."""
    message = str(error) or type(error).__name__
    return et.name_tensor_in_error(message) if isinstance(error, (ValueError, TypeError)) else message


def _token_logprobs(o) -> list[float]:
    return [lp for _, lp, _ in position_logprobs(o.token_ids, o.logprobs)]
