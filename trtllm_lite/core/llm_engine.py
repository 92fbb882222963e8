"""The step loop: validate and add requests, schedule, run, sample, stop, detokenize."""
from __future__ import annotations

import itertools
import time

import numpy as np

from ..detokenizer import IncrementalDetokenizer
from ..engine_dir import load_engine_dir
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampler import Sampler
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .kv_cache_manager import KVCacheManager
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence

DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30


class LLMEngine:
    """Owns the runner, the KV cache manager and the scheduler; :meth:`step` runs one step.

    Args:
        engine_dir: a directory made by ``trtllm-lite build``.
        max_num_seqs, max_num_batched_tokens, max_seq_len: scheduling limits; default and
            upper bound are the engine's build values.
        kv_cache_memory_bytes: memory for the K and V pools (bytes; default 1 GiB, capped at
            what ``max_num_seqs`` sequences of ``max_seq_len`` tokens can use).
        num_kv_blocks: pool size in blocks, overriding ``kv_cache_memory_bytes``.
        enable_chunked_prefill: cut long prompts into budget-sized chunks.
        num_threads: backend threads (default: all cores).
        seed: seed of the generator unseeded sampled requests draw from.
        verify_checksums: check every engine file's sha256 on load.

    Raises:
        EngineError: the engine directory is missing, of another format, or corrupted.
        ValueError: an option is out of range (the message names it).
    """

    def __init__(self, engine_dir: str, *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_seq_len: int | None = None,
                 kv_cache_memory_bytes: int | None = None, num_kv_blocks: int | None = None,
                 enable_chunked_prefill: bool = True, num_threads: int | None = None,
                 seed: int | None = None, verify_checksums: bool = True):
        self.engine = load_engine_dir(engine_dir, verify_checksums=verify_checksums)
        build, model = self.engine.build, self.engine.model
        self.model_config = model
        limits = {}
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_seq_len", max_seq_len)):
            if value is not None and not 1 <= value <= build[name]:
                raise ValueError(f"{name} must be in [1, {build[name]}] (the engine's build value), got {value}")
            limits[name] = value or build[name]
        self.scheduler_config = SchedulerConfig(enable_chunked_prefill=enable_chunked_prefill, **limits)
        self.block_size = build["block_size"]
        bytes_per_block = 2 * model["num_layers"] * self.block_size * model["num_kv_heads"] * model["head_dim"] * 4
        if num_kv_blocks is None:
            budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else DEFAULT_KV_CACHE_MEMORY_BYTES
            if budget < bytes_per_block:
                raise ValueError(f"kv_cache_memory_bytes {budget} is below one KV block ({bytes_per_block} bytes)")
            most = limits["max_num_seqs"] * -(-limits["max_seq_len"] // self.block_size)
            num_kv_blocks = min(budget // bytes_per_block, most)
        elif num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        self.kv = KVCacheManager(num_kv_blocks, self.block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.runner = self._make_runner(num_kv_blocks, num_threads)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.engine.path)
        except FileNotFoundError:
            self.tokenizer = None
        self.eos_token_ids = set(model.get("eos_token_ids") or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(seed)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    def _make_runner(self, num_kv_blocks: int, num_threads: int | None):
        backend = self.engine.backend
        if backend == "onnxruntime":
            from ..runners.onnxruntime_runner import OnnxRuntimeRunner

            return OnnxRuntimeRunner(self.engine, num_kv_blocks, num_threads)
        raise ValueError(f"engine backend {backend!r} has no runner in this runtime")

    # -- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (text or ids), validated.

        Raises:
            ValueError: empty prompt, ids outside ``[0, vocab_size)``, or text without a tokenizer.
            TypeError: the prompt is neither a string nor a list of ints.
        """
        vocab = self.model_config["vocab_size"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt]
            if any(not isinstance(t, (int, np.integer)) for t in prompt):
                raise TypeError("prompt token ids must be integers")
        else:
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.scheduler_config.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_seq_len "
                             f"{self.scheduler_config.max_seq_len}")
        return ids

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """Validate and build a sequence without queueing it (safe from any thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        ids = self.tokenize_prompt(prompt)
        seq = Sequence(request_id or f"req-{next(self._ids)}", ids, params)
        self.scheduler.check_fits(seq)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; return its id. Raises ``ValueError`` / ``TypeError`` on bad input."""
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state; its blocks return at once. Idempotent."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return a delta :class:`RequestOutput` per request that produced a
        token or finished."""
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        logits = self.runner.execute(sched.batch)
        self.num_steps += 1
        now = time.monotonic()
        sampled = []
        for seq, item in zip(sched.seqs, sched.batch.decode + sched.batch.prefill):
            seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                sampled.append(seq)
        outputs = []
        if sampled:
            tokens = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled])
            for seq, token in zip(sampled, tokens.tolist()):
                outputs.append(self._append_token(seq, token, now))
        return outputs

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", (token if token in p.stop_token_ids else None)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.scheduler_config.max_seq_len:
            reason = "length"
        delta = ""
        if seq.detokenizer is not None and reason != "stop":
            delta = seq.detokenizer.step(token)
            seq.text += delta
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
        return self._output(seq, [token], delta)

    def _output(self, seq: Sequence, new_ids: list[int], delta: str) -> RequestOutput:
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                 seq.finish_time, seq.num_preemptions)
        return RequestOutput(seq.request_id, None, seq.prompt_token_ids,
                             [CompletionOutput(0, delta, new_ids, seq.finish_reason, seq.stop_reason)],
                             seq.is_finished, metrics)

    def stats(self) -> dict:
        """KV blocks used/free, waste, running/waiting counts, preemptions, steps."""
        s = self.kv.stats(self.scheduler.running)
        s.update(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                 num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps)
        return s
