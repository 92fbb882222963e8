"""The step loop: validate and add requests, schedule, run, sample, stop, detokenize."""
from __future__ import annotations

import dataclasses
import itertools
import time
import warnings

import numpy as np

from ..detokenizer import IncrementalDetokenizer
from ..engine_dir import load_engine_dir
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampler import Sampler, SamplingRow, TokenLogprobs, log_softmax, top_logprobs
from ..sampling_params import SamplingParams, is_integer
from ..stop_strings import find_stop, held_back
from ..tokenizer import Tokenizer, check_unicode
from .host_memory import KV_POOL_TOO_LARGE, available_memory_bytes, physical_memory_bytes
from .kv_cache_manager import KVCacheManager
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Request, Sequence, SequenceStatus
from ..spec_decode.config import SpeculativeConfig

# The ONNX Runtime CPU backend's token budget per step, as vLLM sets its defaults by usage
# (server vs the offline LLM class). Serving: a step's prompt chunks delay every running
# decode of that step, so the budget bounds the TPOT stall (~0.35 s at 512 on SmolLM2 fp32,
# 2 cores; ~0.7 s at 1024, ~1.6 s at 2048). Offline: fewer, fuller steps win, up to where a
# step's activations leave the cache (prompt steps ran ~1,370 tokens/s at 512-1024, ~1,250 at
# 2048). Measured with the current graphs (GroupQueryAttention for lone prompts, ragged
# decode), interleaved runs: 64 x 128/128 requests 22.3 s at 512, 20.4-21.1 s at 1024,
# 20.7-22.4 s at 2048; 64 random-length requests 205 / 207-225 / 216-218 output tokens/s;
# TTFT of a 2048-token prompt ~2.0-2.2 s at all three. (With the earlier general body for
# every prompt, 512 was the faster: 155 vs 139 tokens/s.)
CPU_MAX_NUM_BATCHED_TOKENS = 512
CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30


def prompt_from_dict(prompt: dict) -> str | list[int]:
    """vLLM's ``TextPrompt`` / ``TokensPrompt``: ``{"prompt": str}`` or
    ``{"prompt_token_ids": [int, ...]}``, exactly one of the two keys and no other.

    Raises:
        ValueError: another key, both keys, or neither.
        TypeError: ``prompt`` is not a str, or ``prompt_token_ids`` is not a list, tuple or
            1-D array.
    """
    keys = set(prompt)
    if keys not in ({"prompt"}, {"prompt_token_ids"}):
        raise ValueError(f"a dict prompt takes exactly one of 'prompt' or 'prompt_token_ids', "
                         f"got keys {sorted(map(repr, keys))}")
    if "prompt" in keys:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"'prompt' must be a str (token ids go in 'prompt_token_ids'), got "
                            f"{type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, (list, tuple, np.ndarray)):
        hint = " (text goes in 'prompt')" if isinstance(ids, str) else ""
        raise TypeError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}{hint}")
    return ids


def default_max_num_batched_tokens(build: dict, max_num_seqs: int, offline: bool = False) -> int:
    """The token budget an engine uses when not given one (chunked prefill on): the build
    value, capped on the ONNX Runtime CPU backend at :data:`CPU_MAX_NUM_BATCHED_TOKENS`
    (serving) or :data:`CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS` (``offline``), never below
    ``max_num_seqs`` (every running sequence's decode fits one step)."""
    if build.get("backend", "onnxruntime") != "onnxruntime":
        return build["max_num_batched_tokens"]
    cap = CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS if offline else CPU_MAX_NUM_BATCHED_TOKENS
    return min(build["max_num_batched_tokens"], max(cap, max_num_seqs))


class LLMEngine:
    """Owns the runner, the KV cache manager and the scheduler; :meth:`step` runs one step.

    Args:
        engine_dir: a directory made by ``trtllm-lite build``.
        max_num_seqs, max_num_batched_tokens, max_seq_len: scheduling limits; upper bound
            and default are the engine's build values, except ``max_num_batched_tokens`` on
            the ONNX Runtime CPU backend with chunked prefill, which defaults to at most
            :data:`CPU_MAX_NUM_BATCHED_TOKENS`, or :data:`CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS`
            with ``offline`` (see their note; :func:`default_max_num_batched_tokens`).
        kv_cache_memory_bytes: memory for the K and V pools (bytes; default 1 GiB, capped at
            what ``max_num_seqs`` sequences of ``max_seq_len`` tokens can use); a float16
            pool (build's kv_cache_dtype) fits twice the blocks of a float32 one.
        num_kv_blocks: pool size in blocks, overriding ``kv_cache_memory_bytes``.
        kv_cache_prefault: commit the pool's memory at start (ONNX Runtime: the pools are
            written once while loading, ~0.1-1.2 s/GB here), as a GPU pool's allocation
            does: no step pays the page faults (1.03-1.10x on the 64 random-length requests
            of ``tools/bench.py``), and a host short of memory fails at start, not under
            load. False commits pages as blocks are first written, so RSS follows the peak
            load instead of the pool's size.
        enable_chunked_prefill: cut long prompts into budget-sized chunks.
        enable_prefix_caching: share full KV blocks between requests with equal prefixes.
        max_waiting: waiting requests at most; more raise ``OverflowError`` (queue full).
        num_threads: backend threads (default: all cores).
        seed: seed of the generator unseeded sampled requests draw from.
        verify_checksums: check every engine file's sha256 on load.
        speculative_config: speculative decoding (see :class:`SpeculativeConfig`), e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4}``; None turns it off.
        offline: batch use (the :class:`~trtllm_lite.llm.LLM` class): defaults favour
            throughput over per-token latency (the CPU token budget).

    Raises:
        EngineError: the engine directory is missing, of another format, or corrupted.
        ValueError: an option is not an integer or out of range (the message names it),
            ``num_kv_blocks`` needs more memory than the machine has (ONNX Runtime: host
            memory), the pool to prefault is larger than the memory available now, or
            ``max_num_batched_tokens`` (given or default) is below ``max_num_seqs``.
    """

    def __init__(self, engine_dir: str, *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_seq_len: int | None = None,
                 kv_cache_memory_bytes: int | None = None, num_kv_blocks: int | None = None,
                 kv_cache_prefault: bool = True, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True,
                 max_waiting: int = 1 << 20, num_threads: int | None = None,
                 seed: int | None = None, verify_checksums: bool = True,
                 speculative_config: "SpeculativeConfig | dict | None" = None, offline: bool = False):
        for name, value in (("enable_chunked_prefill", enable_chunked_prefill),
                            ("enable_prefix_caching", enable_prefix_caching),
                            ("verify_checksums", verify_checksums), ("offline", offline),
                            ("kv_cache_prefault", kv_cache_prefault)):
            if not isinstance(value, (bool, np.bool_)):   # ("no" is truthy: it turned the feature on)
                raise ValueError(f"{name} must be a bool, got {value!r}")
        self.engine = load_engine_dir(engine_dir, verify_checksums=verify_checksums)
        build, model = self.engine.build, self.engine.model
        self.model_config = model
        limits = {}
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_seq_len", max_seq_len)):
            low = 2 if name == "max_seq_len" else 1     # one prompt token and one output token
            if value is not None and (not is_integer(value) or not low <= value <= build[name]):
                raise ValueError(f"{name} must be an integer in [{low}, {build[name]}] (the engine's build "
                                 f"value), got {value!r}")
            limits[name] = int(value) if value is not None else build[name]
        if max_num_batched_tokens is None and enable_chunked_prefill:
            limits["max_num_batched_tokens"] = default_max_num_batched_tokens(build, limits["max_num_seqs"], offline)
        if limits["max_num_batched_tokens"] < limits["max_num_seqs"]:
            raise ValueError(f"max_num_batched_tokens ({limits['max_num_batched_tokens']}) must be greater than "
                             f"or equal to max_num_seqs ({limits['max_num_seqs']}): a step must hold one "
                             "token of every running sequence")
        # (QA 25: strings, floats and bools failed inside numpy or ONNX Runtime, naming nothing)
        for name, value in (("kv_cache_memory_bytes", kv_cache_memory_bytes), ("num_kv_blocks", num_kv_blocks),
                            ("num_threads", num_threads), ("max_waiting", max_waiting)):
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if seed is not None and (not is_integer(seed) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.scheduler_config = SchedulerConfig(enable_chunked_prefill=enable_chunked_prefill,
                                                max_waiting=max_waiting, **limits)
        self.block_size = build["block_size"]
        # the pools' element: kv_cache_dtype on ONNX Runtime, the precision on TensorRT
        kv_itemsize = 2 if self.engine.kv_pool_dtype in ("float16", "bfloat16") else 4
        bytes_per_block = 2 * model["num_layers"] * self.block_size * model["num_kv_heads"] * model["head_dim"] * kv_itemsize
        if num_kv_blocks is None:
            budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else DEFAULT_KV_CACHE_MEMORY_BYTES
            if budget < bytes_per_block:
                raise ValueError(f"kv_cache_memory_bytes {budget} is below one KV block ({bytes_per_block} bytes)")
            most = limits["max_num_seqs"] * -(-limits["max_seq_len"] // self.block_size)
            num_kv_blocks = min(budget // bytes_per_block, most)
        elif self.engine.backend == "onnxruntime" and num_kv_blocks * bytes_per_block > physical_memory_bytes():
            raise ValueError(f"num_kv_blocks {num_kv_blocks} needs {num_kv_blocks * bytes_per_block} bytes of K/V "
                             f"pools, more than this machine's memory ({physical_memory_bytes()} bytes)")
        pool_bytes = num_kv_blocks * bytes_per_block
        self.kv_cache_prefault = bool(kv_cache_prefault) and self.engine.backend == "onnxruntime"
        # (before loading anything; the runner checks again once the weights are in)
        available = available_memory_bytes() if self.kv_cache_prefault else None
        if available is not None and pool_bytes > available:
            raise ValueError(KV_POOL_TOO_LARGE.format(pool_bytes, available))
        self.kv = KVCacheManager(num_kv_blocks, self.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.runner = self._make_runner(num_kv_blocks, num_threads)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.engine.path)
        except FileNotFoundError:
            self.tokenizer = None
        self.eos_token_ids = set(model.get("eos_token_ids") or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        outside = {i for i in self.eos_token_ids if not 0 <= i < model["vocab_size"]}
        if outside:   # (QA: GPT-2's default 50256 in a smaller vocabulary: min_tokens indexed past the logits)
            warnings.warn(f"end-of-sequence ids {sorted(outside)} are outside the vocabulary ({model['vocab_size']} "
                          "tokens): never generated, ignored", stacklevel=2)
            self.eos_token_ids -= outside
        self.sampler = Sampler(seed)
        self.spec_config = SpeculativeConfig.from_any(speculative_config)
        self.proposer = self._make_proposer(num_kv_blocks, num_threads)
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0

    def _make_runner(self, num_kv_blocks: int, num_threads: int | None):
        backend = self.engine.backend
        if backend == "onnxruntime":
            from ..runners.onnxruntime_runner import OnnxRuntimeRunner

            return OnnxRuntimeRunner(self.engine, num_kv_blocks, num_threads,
                                     prefault_kv_cache=self.kv_cache_prefault)
        if backend in ("tensorrt", "tensorrt-rtx"):
            from ..runners.tensorrt_runner import TensorRTRunner

            return TensorRTRunner(self.engine, num_kv_blocks, num_threads)
        raise ValueError(f"engine backend {backend!r} has no runner in this runtime")

    def _make_proposer(self, num_kv_blocks: int, num_threads: int | None):
        c = self.spec_config
        if c is None:
            return None
        if c.method == "ngram":
            from ..spec_decode.ngram_proposer import NgramProposer

            return NgramProposer(c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max)
        from ..spec_decode.draft_proposer import DraftModelProposer

        return DraftModelProposer(c.draft_engine, c.num_speculative_tokens,
                                  c.draft_num_kv_blocks or num_kv_blocks, self.model_config["vocab_size"],
                                  num_threads, prefault_kv_cache=self.kv_cache_prefault)

    # -- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (text or ids), validated.

        Raises:
            ValueError: empty prompt, ids outside ``[0, vocab_size)``, more tokens than
                ``max_seq_len``, or text without a tokenizer.
            TypeError: the prompt is neither a string nor a list of ints.
        """
        vocab = self.model_config["vocab_size"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt, max_tokens=self.scheduler_config.max_seq_len)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
                raise TypeError("prompt token ids must be integers")
            ids = [int(t) for t in prompt]
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

    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                     request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Validate and build a request without queueing it (safe from any thread).

        ``prompt``: text, token ids, or vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids":
        [int, ...]}`` dicts (:func:`prompt_from_dict`).

        Raises ``ValueError`` / ``TypeError`` naming the problem.
        """
        if isinstance(prompt, dict):
            prompt = prompt_from_dict(prompt)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        # the request's own copy, checked again (as vLLM clones them): a SamplingParams changed
        # after it was made (n = 0 spun forever, a negative logit_bias id biased the vocabulary's
        # end; QA 25) is refused, and one changed later does not reach a running request
        params = dataclasses.replace(params)
        params.check_vocab(self.model_config["vocab_size"])
        if params.n > self.scheduler_config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.scheduler_config.max_num_seqs})")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError("cache_salt must be a string")
        if cache_salt == "":      # as vLLM: an empty salt would silently share the unsalted space
            raise ValueError("cache_salt must be a non-empty string if given")
        if cache_salt is not None:   # (hashed into every block's key during a step: QA 23)
            check_unicode(cache_salt, "cache_salt")
        ids = self.tokenize_prompt(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id must be a non-empty string")
        check_unicode(rid, "request_id")
        if params.stop and self.tokenizer is None:   # (no text to match: QA 25 got an AttributeError)
            raise ValueError("stop needs a tokenizer; this engine has none (stop_token_ids work without)")
        if params.stop:   # (matched against the text at every new token; one longer than
            self.check_words_length(params.stop, "stop")   # max_seq_len tokens never matches)
        request = Request(rid, prompt if isinstance(prompt, str) else None, ids, params,
                          bad_words_ids=self._bad_words_ids(params.bad_words))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        request.seqs.append(self._new_sequence(request, 0, cache_salt))
        self.scheduler.check_fits(request.seqs[0])
        return request

    def check_words_length(self, words: list[str], name: str) -> None:
        """Refuse words a request asks to tokenize beside its prompt (``bad_words``, KServe's
        ``embedding_bias_words``) or to match in its text (``stop``: each is searched for at
        every new token; QA 19 sent 100,000) that are more than ``max_seq_len`` words, or have more
        characters in all than ``max_seq_len`` tokens can cover, before any is tokenized, as an
        over-long prompt is: tokenizing runs where the request is made (a server's event loop),
        and 2 MB of bad words held it ~5 s; 331k one-character words, within the character
        limit, held it ~5 s too (one tokenizer call per word and variant).

        Raises:
            ValueError: naming ``name``, the words or characters sent and the limit.
        """
        limit = self.scheduler_config.max_seq_len
        if len(words) > limit:
            raise ValueError(f"{name} has {len(words)} words: more than max_seq_len ({limit})")
        per_token = self.tokenizer.max_chars_per_token
        total = sum(len(w) for w in words)
        if total > limit * per_token:
            raise ValueError(f"{name} has {total} characters in all: more than {limit} tokens can "
                             f"hold (at most {per_token} characters a token)")

    def _bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Token sequences of each bad word, with and without a leading space (as vLLM);
        words past :meth:`check_words_length`'s limits are refused before any is tokenized."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        self.check_words_length(words, "bad_words")
        seqs = set()
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False, name="bad_words")
                if ids:
                    seqs.add(tuple(ids))
        return tuple(sorted(seqs))

    def _new_sequence(self, request: Request, index: int, cache_salt: str | None) -> Sequence:
        seq = Sequence(request.request_id, request.prompt_token_ids, request.params, index=index,
                       cache_salt=cache_salt, request=request)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     request.params.skip_special_tokens)
        return seq

    def add(self, request: Request) -> None:
        """Queue a request made by :meth:`make_request`.

        Raises ``ValueError`` for a request id in use, ``OverflowError`` when the waiting
        queue is full.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.scheduler.add(request.seqs[0])
        self.requests[request.request_id] = request

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request; return its id. Raises ``ValueError`` / ``TypeError`` on bad input."""
        request = self.make_request(prompt, params, request_id, cache_salt)
        self.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state; its blocks return at once. Idempotent: returns the
        final output the first time, None after (or for an unknown id)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
            if self.proposer is not None:
                self.proposer.release(seq)
        return self._request_output(request, [(s, self._completion(s, [], "", [])) for s in request.seqs])

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output, tokens) this engine can run: ``max_seq_len``,
        or the whole KV pool's tokens when the pool is smaller (vLLM's ``max_model_len``)."""
        return min(self.scheduler_config.max_seq_len, self.kv.pool.num_blocks * self.block_size)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return one delta :class:`RequestOutput` per request that produced
        tokens or finished (``outputs`` holds the sequences that changed)."""
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if self.proposer is not None:   # a preempted sequence's draft blocks go back too (QA: kept)
            for seq in sched.preempted:
                self.proposer.release(seq)
        if not sched.seqs:
            return []
        items = sched.batch.decode + sched.batch.prefill
        for seq, item in zip(sched.seqs, items):
            if self._wants_prompt_logprobs(seq):
                item.num_logits = item.num_new_tokens
        self.runner.copy_blocks(self.kv.take_pending_copies())
        logits = self.runner.execute(sched.batch)
        self.num_steps += 1
        now = time.monotonic()
        to_verify: list[tuple[Sequence, list[int], list[int]]] = []   # (seq, logits rows, drafts)
        row = 0
        for seq, item in zip(sched.seqs, items):
            first_row, row = row, row + item.num_logits
            if self._wants_prompt_logprobs(seq):
                self._add_prompt_logprobs(seq, item.start, logits[first_row:row])
            drafts = seq.spec_token_ids
            seq.spec_token_ids = []
            # draft tokens' K/V count as computed only once accepted
            seq.num_computed_tokens += item.num_new_tokens - len(drafts)
            if not drafts:
                self.kv.cache_full_blocks(seq)
            if item.samples:
                first_sample_row = row - 1 - len(drafts)   # the logits after the last computed token
                to_verify.append((seq, list(range(first_sample_row, row)), drafts))
                request = seq.request
                if seq.index == 0 and len(request.seqs) < request.params.n:
                    # the other samples of a prompt whose last prefill chunk carried drafts
                    # start from the same row as the first (QA 25: they took the last draft's)
                    to_verify += [(child, [first_sample_row], []) for child in self._fork(seq)]
        if not to_verify:
            return []
        changed = self._sample_and_verify(logits, to_verify, now)
        by_request: dict[str, list] = {}
        for seq, completion in changed.items():
            by_request.setdefault(seq.request_id, []).append((seq, completion))
        return [self._request_output(group[0][0].request, group) for group in by_request.values()]

    def _sample_and_verify(self, logits: np.ndarray, to_verify, now: float) -> dict:
        """Sample every sequence's next token; for sequences with draft tokens, walk the
        drafts position by position and stop at the first the target does not sample.

        Proposals are deterministic (n-gram lookup, a draft model's argmax): the proposal
        distribution q is a point mass on draft x, and the rejection rule of Leviathan et al.
        2023 / Chen et al. 2023 (accept x with probability min(1, p(x)/q(x)) = p(x); on
        rejection sample from (p - q)+, i.e. p without x) is exactly "draw y ~ p with the
        request's generator; accept iff y == x, else emit y". One uniform per emitted token,
        as in plain decoding, so seeded outputs are identical with speculation on or off.
        """
        changed: dict[Sequence, CompletionOutput] = {}
        active, position = to_verify, 0
        while active:
            seqs = [s for s, _, _ in active]
            rows = [SamplingRow(s.params, s.generator, s.prompt_token_ids, s.output_token_ids,
                                () if s.num_output_tokens >= s.params.min_tokens else self._stop_ids(s.params),
                                s.request.bad_words_ids)
                    for s in seqs]
            picked = [r[position] for _, r, _ in active]
            # every row in order (plain decode): the logits as they are, not a copy
            same = len(picked) == len(logits) and picked == list(range(len(logits)))
            tokens, lps = self.sampler(logits if same else logits[picked], rows)
            still = []
            for (seq, rows_, drafts), token, lp in zip(active, tokens.tolist(), lps):
                self._merge(changed, seq, self._append_token(seq, token, lp, now))
                accepted = position < len(drafts) and token == drafts[position] and not seq.is_finished
                if accepted:
                    seq.num_computed_tokens += 1
                    still.append((seq, rows_, drafts))
                elif drafts:
                    self._end_verification(seq, drafts, position)
            active, position = still, position + 1
        self.num_generated_tokens += sum(len(c.token_ids) for c in changed.values())
        return changed

    def _end_verification(self, seq: Sequence, drafts: list[int], num_accepted: int) -> None:
        """Roll back the rejected drafts' KV (trim the block table) and record the outcome."""
        st = self.spec_stats
        st["num_drafts"] += 1
        st["num_draft_tokens"] += len(drafts)
        st["num_accepted_tokens"] += num_accepted
        seq.spec_acceptance = 0.5 * seq.spec_acceptance + 0.5 * num_accepted / len(drafts)
        c = self.spec_config
        if seq.spec_acceptance < c.min_acceptance_rate:     # back off, doubling the wait each time
            seq.spec_backoff = min(max(2 * seq.spec_backoff, c.backoff_probe_interval), 64)
            seq.spec_next_probe = self.num_steps + seq.spec_backoff
        else:
            seq.spec_backoff = 0
        if not seq.is_finished:
            keep = -(-seq.num_computed_tokens // self.block_size)
            if len(seq.block_table) > keep:
                self.kv.pool.free(seq.block_table[keep:])
                del seq.block_table[keep:]
            self.kv.cache_full_blocks(seq)

    @staticmethod
    def _merge(changed: dict, seq: Sequence, c: CompletionOutput) -> None:
        prev = changed.get(seq)
        if prev is None:
            changed[seq] = c
            return
        prev.text += c.text
        prev.token_ids += c.token_ids
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
        if prev.logprobs is not None:
            prev.logprobs += c.logprobs or []

    def _draft_length(self, seq: Sequence) -> int:
        """Draft tokens worth verifying for ``seq``: each draft costs a token of compute in
        the verification pass, and with a per-token acceptance rate a the chance that draft j
        is reached and accepted is a**j, so low-acceptance sequences propose fewer."""
        k, a = self.spec_config.num_speculative_tokens, seq.spec_acceptance
        if seq.spec_backoff or a < 0.4:
            return 1
        return k if a >= 0.6 else min(k, 2)

    def _propose(self) -> None:
        """Ask the proposer for draft tokens for running sequences that are decoding."""
        c = self.spec_config
        seqs, limits = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.request.prompt_logprobs is not None \
                    and len(seq.request.prompt_logprobs) < seq.num_prompt_tokens:
                continue
            if seq.spec_backoff and self.num_steps < seq.spec_next_probe:
                continue       # backed off: proposals were mostly rejected lately
            room = min(seq.params.max_tokens - seq.num_output_tokens,
                       self.scheduler_config.max_seq_len - seq.num_tokens) - 1
            seqs.append(seq)
            limits.append(min(self._draft_length(seq), room))
        if seqs:
            for seq, drafts in zip(seqs, self.proposer.propose(seqs, limits)):
                seq.spec_token_ids = list(drafts)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Make the request's other n - 1 sequences; they share the parent's blocks."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = self._new_sequence(request, index, parent.cache_salt)
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.arrival_time = parent.arrival_time
            child.first_scheduled_time = parent.first_scheduled_time
            child.status = SequenceStatus.RUNNING
            self.kv.fork(parent, child)
            # not the blocks past the prompt that hold the parent's draft tokens (speculative
            # decoding): the child would write its own tokens into them, shared, unseen by
            # copy-on-write (which copies only a partly filled block)
            keep = -(-child.num_computed_tokens // self.block_size)
            if len(child.block_table) > keep:
                self.kv.pool.free(child.block_table[keep:])
                del child.block_table[keep:]
            self.scheduler.running.append(child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return eos + tuple(params.stop_token_ids)

    def _request_of(self, seq: Sequence) -> Request:
        return seq.request

    def _wants_prompt_logprobs(self, seq: Sequence) -> bool:
        request = seq.request
        return (request.prompt_logprobs is not None and seq.index == 0
                and len(request.prompt_logprobs) < seq.num_prompt_tokens)

    def _add_prompt_logprobs(self, seq: Sequence, start: int, rows: np.ndarray) -> None:
        """Row j holds the logits after token ``start + j``: the distribution of the next
        prompt token (raw model distribution, as vLLM reports prompt logprobs)."""
        request = seq.request
        n = request.params.prompt_logprobs
        for j in range(len(rows)):
            pos = start + j + 1
            if pos >= seq.num_prompt_tokens or pos < len(request.prompt_logprobs):
                continue
            token = seq.prompt_token_ids[pos]
            request.prompt_logprobs.append(self._logprob_dict(
                top_logprobs(log_softmax(rows[j:j + 1].astype(np.float32))[0], token, n), token))

    def _logprob_dict(self, lp: TokenLogprobs, token: int) -> dict[int, Logprob]:
        # the token's own bytes as text: a SentencePiece token keeps the space that decoding it
        # alone strips (QA), so the tokens join to the text; part of a character is U+FFFD
        tok = self.tokenizer
        decode = (lambda t: tok.token_bytes(t).decode("utf-8", "replace")) if tok else (lambda t: None)
        out = {int(t): Logprob(float(v), i + 1, decode(int(t))) for i, (t, v) in enumerate(zip(lp.token_ids, lp.logprobs))}
        if token not in out:
            out[token] = Logprob(lp.logprob, lp.rank, decode(token))
        return out

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float) -> CompletionOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", (token if token in p.stop_token_ids else None)
            if p.include_stop_str_in_output and seq.detokenizer is not None:   # vLLM's: the stop token's
                seq.text += seq.detokenizer.step(token)      # text too (none for a skipped special token)
        if reason is None and seq.detokenizer is not None:
            delta = seq.detokenizer.step(token)
            seq.text += delta
            if p.stop and delta and seq.num_output_tokens >= p.min_tokens:
                hit = find_stop(seq.text, len(delta), p.stop)
                if hit is not None:
                    index, stop = hit
                    seq.text = seq.text[:index + (len(stop) if p.include_stop_str_in_output else 0)]
                    reason, seq.stop_reason = "stop", stop
        if reason is None and (seq.num_output_tokens >= p.max_tokens
                               or seq.num_tokens >= self.scheduler_config.max_seq_len):
            reason = "length"
        logprobs = []
        if lp is not None:
            logprobs = [self._logprob_dict(lp, token)]
            seq.logprobs.extend(logprobs)
        release = len(seq.text) if reason else len(seq.text) - held_back(seq.text, p.stop)
        delta_text = seq.text[seq.num_text_sent:release]
        seq.num_text_sent = max(seq.num_text_sent, release)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if self.proposer is not None:
                self.proposer.release(seq)
            if seq.request.finished:
                self.requests.pop(seq.request_id, None)
        return self._completion(seq, [token], delta_text, logprobs)

    def _completion(self, seq: Sequence, ids: list[int], text: str, logprobs: list) -> CompletionOutput:
        return CompletionOutput(seq.index, text, ids, seq.finish_reason, seq.stop_reason,
                                logprobs if seq.params.logprobs is not None else None)

    def _request_output(self, request: Request, changed: list[tuple[Sequence, CompletionOutput]]) -> RequestOutput:
        first = request.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 max((s.finish_time or 0) for s in request.seqs) if request.finished else None,
                                 sum(s.num_preemptions for s in request.seqs))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [c for _, c in changed], request.finished, metrics,
                             request.num_cached_tokens, request.prompt_logprobs)

    def final_output(self, request: Request) -> RequestOutput:
        """The cumulative output of a request: every sequence's whole text and tokens."""
        return self._request_output(request, [
            (s, self._completion(s, s.output_token_ids, s.text[:s.num_text_sent] if not s.is_finished else s.text,
                                 s.logprobs or [])) for s in request.seqs])

    def stats(self) -> dict:
        """KV blocks used/free/cached, waste, prefix hits, running/waiting counts,
        preemptions, steps and generated tokens."""
        s = self.kv.stats(self.scheduler.running)
        s.update(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                 num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
                 num_generated_tokens=self.num_generated_tokens)
        if self.spec_config is not None:
            st = self.spec_stats
            s.update({f"spec_{k}": v for k, v in st.items()})
            s["spec_acceptance_rate"] = (st["num_accepted_tokens"] / st["num_draft_tokens"]
                                         if st["num_draft_tokens"] else 0.0)
            s["spec_mean_accepted_length"] = (1 + st["num_accepted_tokens"] / st["num_drafts"]
                                              if st["num_drafts"] else 0.0)
            if hasattr(self.proposer, "kv"):
                s["spec_draft_blocks_used"] = self.proposer.kv.pool.num_used
        return s
