"""The peers the benchmarks compare against, fed the same token ids with greedy settings.

* :class:`HFPeer`: HF transformers ``generate`` (fp32, eager PyTorch on the CPU), batch 1
  and static batches (left-padded, every row run to the batch's longest output).
* :class:`GenAIPeer`: onnxruntime-genai (``pip install onnxruntime-genai``), one request
  at a time, from a model directory its builder made from an HF directory.
* :class:`LlamaCppPeer`: llama.cpp through ``llama-cpp-python`` on a GGUF file, when installed.

Each exposes ``latency(prompt, max_tokens) -> {ttft_ms, decode_tokens_per_s, tpot_ms}`` and
``generate_ids(prompt, max_tokens) -> list[int]`` (greedy), times from ``time.perf_counter``.
"""
from __future__ import annotations

import importlib.util
import os
import time


def decode_rate(t_first: float, t_all: float, max_tokens: int) -> dict[str, float]:
    """TTFT and decode speed from two timed runs: one token (``t_first`` s) and
    ``max_tokens`` tokens (``t_all`` s) from the same prompt."""
    tpot = (t_all - t_first) / (max_tokens - 1)
    return {"ttft_ms": t_first * 1e3, "tpot_ms": tpot * 1e3, "decode_tokens_per_s": 1.0 / tpot}


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def run_rates(prompts: list[list[int]], max_tokens: list[int], wall: float) -> dict:
    """``{wall_s, output_tokens, output_tokens_per_s, total_tokens_per_s}`` of a finished run."""
    out = sum(max_tokens)
    return {"wall_s": wall, "output_tokens": out, "output_tokens_per_s": out / wall,
            "total_tokens_per_s": (out + sum(map(len, prompts))) / wall}


class Peer:
    """What every peer shares; a subclass implements ``_run(prompt, max_tokens) -> ids``."""

    def _run(self, prompt: list[int], max_tokens: int) -> list[int]:
        raise NotImplementedError

    def generate_ids(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self._run(prompt, max_tokens)

    def latency(self, prompt: list[int], max_tokens: int, repeats: int = 3) -> dict[str, float]:
        t1 = _best(lambda: self._run(prompt, 1), repeats)
        tn = _best(lambda: self._run(prompt, max_tokens), repeats)
        return decode_rate(t1, tn, max_tokens)


    def sequential(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        """One request at a time, in order (see :func:`run_rates`)."""
        t = time.perf_counter()
        for p, k in zip(prompts, max_tokens):
            self._run(p, k)
        return run_rates(prompts, max_tokens, time.perf_counter() - t)


def load_hf_model(model_path: str, num_threads: int):
    """transformers' own loader: a GGUF file (dequantized to fp32) or an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(num_threads)
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                     gguf_file=os.path.basename(model_path),
                                                     torch_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    return model.eval()


class HFPeer(Peer):
    """HF transformers ``generate``, greedy, fp32, ``num_threads`` intra-op threads."""

    name = "HF transformers"

    def __init__(self, model_path: str, num_threads: int = 2, model=None):
        import torch

        self.torch = torch
        self.model = model if model is not None else load_hf_model(model_path, num_threads)
        torch.set_num_threads(num_threads)

    def _generate(self, batch: list[list[int]], max_tokens: int):
        torch = self.torch
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            return self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                       eos_token_id=None)[:, width:]

    def _run(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self._generate([prompt], max_tokens)[0].tolist()

    def static_batches(self, prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> dict:
        """Static batching: requests in arrival order, ``batch_size`` at a time, each batch
        padded to its longest prompt and run to its longest output. Only each request's own
        ``max_tokens`` count as output (see :func:`run_rates`)."""
        t = time.perf_counter()
        for s in range(0, len(prompts), batch_size):
            self._generate(prompts[s:s + batch_size], max(max_tokens[s:s + batch_size]))
        return run_rates(prompts, max_tokens, time.perf_counter() - t)


class GenAIPeer(Peer):
    """onnxruntime-genai on a model directory its builder wrote (``genai_config.json``)."""

    name = "onnxruntime-genai"

    def __init__(self, model_dir: str, num_threads: int = 2):
        import json

        import onnxruntime_genai as og

        self.og = og
        path = os.path.join(model_dir, "genai_config.json")
        with open(path) as f:
            cfg = json.load(f)
        opts = cfg["model"]["decoder"].setdefault("session_options", {})
        if opts.get("intra_op_num_threads") != num_threads:   # genai takes threads from its config
            opts["intra_op_num_threads"] = num_threads
            with open(path, "w") as f:
                json.dump(cfg, f, indent=4)
        config = og.Config(model_dir)
        self.model = og.Model(config)
        self.num_threads = num_threads

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("onnxruntime_genai") is not None

    def tpot_rate(self, prompt: list[int], max_tokens: int) -> float:
        """Batch-1 decode tokens/s as our engine's figure is taken (``run_requests``): 1 / TPOT,
        the mean time of a token after the first, as vLLM defines it ((end - first token) /
        (tokens - 1); ``max_tokens`` tokens from ``prompt``, one run)."""
        gen = self._generator(prompt, max_tokens)
        gen.generate_next_token()       # the prompt and the first token: TTFT, not decode
        gen.get_next_tokens()
        t, count = time.perf_counter(), 0
        while not gen.is_done() and count < max_tokens - 1:
            gen.generate_next_token()
            gen.get_next_tokens()
            count += 1
        return count / (time.perf_counter() - t)

    def _generator(self, prompt: list[int], max_tokens: int):
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + max_tokens,
                                  min_length=len(prompt) + max_tokens, batch_size=1)
        gen = og.Generator(self.model, params)
        gen.append_tokens([prompt])
        return gen

    def _run(self, prompt: list[int], max_tokens: int) -> list[int]:
        gen = self._generator(prompt, max_tokens)
        out = []
        while not gen.is_done() and len(out) < max_tokens:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out



class LlamaCppPeer(Peer):
    """llama.cpp through ``llama-cpp-python`` (only when that package is installed)."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, num_threads: int = 2, n_ctx: int = 4096):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=num_threads,
                         n_threads_batch=num_threads, n_batch=512, verbose=False, logits_all=False)

    @staticmethod
    def available() -> bool:
        """Installed and importable (a ``--no-deps`` install without ``diskcache`` is not)."""
        try:
            import llama_cpp  # noqa: F401
        except Exception:   # (ImportError, or a library that does not load on this CPU)
            return False
        return True

    def _run(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.llm.reset()
        out = []
        for tok in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) >= max_tokens:
                break
        return out

