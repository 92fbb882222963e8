"""Time the CUDA paged-attention kernels against PyTorch SDPA and the device copy bandwidth.

Run on a GPU machine (PyTorch is used only here, to allocate, time and provide the peer):

    python3 tools/bench_cuda_attention.py --out device_check.md

Decode: for each head config, context (1k..32k) and batch (1..64), one query token per sequence
reads B * (ctx + 1) * kv_heads * head_dim * 2 (K and V) * 2 bytes of K/V. "Achieved bandwidth"
is those bytes over the kernel time, for every decode kernel variant (VARIANTS). The peer is
``torch.nn.functional.scaled_dot_product_attention`` on a contiguous cache
[B, kv_heads, ctx + 1, head_dim] holding the same values (``enable_gqa``). The bound is the
measured device copy bandwidth (bytes read + written per second; the faster of a memcpy and an
elementwise copy kernel); a sum reduction's read bandwidth is printed beside it.
Timing: CUDA graphs of R launches (R rotating input sets, so small problems are not served from
L2), replayed several times; the median replay over R.

``--dry-run`` exercises the plumbing on the CPU with tiny sizes and a torch stand-in for the kernel;
``--emulation LIB`` does the same with the kernels' CPU emulation build (plugins_cu/build.sh
--emulation) launched on CPU tensors, so every code path but the CUDA timing runs without a GPU.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEAD_CONFIGS = {  # name: (num_heads, num_kv_heads, head_dim)
    "Llama-8B-like": (32, 8, 128),
    "SmolLM2-like": (9, 3, 64),
}
# Diagnostic rows: one KV head (its 256-byte rows are contiguous across a block's slots), to
# tell the paged layout's strided rows apart from the kernels' own limits.
DIAGNOSTIC_CASES = [("1-KV-head", (8, 1, 128), batch, 32768) for batch in (16, 64)]
CONTEXTS = [1024, 4096, 16384, 32768]
BATCHES = [1, 4, 16, 64]
ROTATE_BYTES = 256 << 20  # each timed graph touches at least this much K/V
# Decode kernel variants timed: name -> (tl kernel, mma prefetch 1 / 0, or -1 = the default).
# The default is "mma" with prefetch on for head_dim 128 and off for 64.
VARIANTS = {
    "mma+prefetch": ("mma", 1),
    "mma+direct": ("mma", 0),
    "pipelined": ("pipelined", -1),
    "registers": ("registers", -1),
}


@dataclass
class Row:
    model: str
    heads: tuple
    batch: int
    context: int
    kv_bytes: int
    times_us: dict      # decode kernel variant (VARIANTS) -> µs
    sdpa_us: float
    rel_err: float
    splits: int


def median_replay_ms(launches, reps: int, device: str) -> float:
    """Median time of one launch (ms): CUDA-graph of all launches, replayed `reps` times."""
    if device == "cpu":
        t0 = time.perf_counter()
        for fn in launches:
            fn()
        return (time.perf_counter() - t0) * 1e3 / len(launches)
    for fn in launches[:2]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(launches)


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: the best of a device-to-device copy and an elementwise
    kernel copy (bytes read + written), and a sum reduction (bytes read).

    A copy captured in a CUDA graph becomes a memcpy node, which may run on a copy engine well
    below what kernels reach, so the kernel copy is measured too and the faster one is the bound.
    """
    if device == "cpu":
        nbytes = 64 << 20
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    a.uniform_()
    b = torch.empty_like(a)
    copies = [median_replay_ms([lambda: b.copy_(a)], reps=20, device=device),
              median_replay_ms([lambda: torch.mul(a, 1.0, out=b)], reps=20, device=device)]
    read_ms = median_replay_ms([lambda: a.sum()], reps=20, device=device)
    print(f"copy (memcpy) {2 * nbytes / copies[0] / 1e9:.3f} TB/s, copy (kernel) "
          f"{2 * nbytes / copies[1] / 1e9:.3f} TB/s, read (sum) {nbytes / read_ms / 1e9:.3f} TB/s",
          flush=True)
    del a, b
    return 2 * nbytes / (min(copies) * 1e-3), nbytes / (read_ms * 1e-3)


class PagedCase:
    """R rotating paged caches (one pool, disjoint random blocks) and their contiguous twins."""

    def __init__(self, heads, batch, context, block_size, dtype, device, rotations, seed=0):
        nh, nkv, d = heads
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.heads, self.batch, self.block_size = heads, batch, block_size
        self.seq_len = context + 1
        self.blocks_per_seq = -(-self.seq_len // block_size)
        per_rot = batch * self.blocks_per_seq
        num_blocks = per_rot * rotations
        shape = (num_blocks, block_size, nkv, d)
        self.key_cache = torch.randn(shape, dtype=dtype, device=device)
        self.value_cache = torch.randn(shape, dtype=dtype, device=device)
        perm = torch.randperm(num_blocks, generator=gen).to(device)
        self.block_tables = [perm[r * per_rot:(r + 1) * per_rot].view(batch, -1).contiguous()
                             for r in range(rotations)]
        self.context_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.query = [torch.randn(batch, nh, d, dtype=dtype, device=device)
                      for _ in range(rotations)]
        self.out = torch.empty(batch, nh, d, dtype=dtype, device=device)

    def contiguous_kv(self, r):
        """[B, kv_heads, seq_len, D] copies of rotation r's K and V (the SDPA peer's cache)."""
        bt = self.block_tables[r]
        k = self.key_cache[bt].flatten(1, 2)[:, :self.seq_len].transpose(1, 2).contiguous()
        v = self.value_cache[bt].flatten(1, 2)[:, :self.seq_len].transpose(1, 2).contiguous()
        return k, v

    def kv_bytes(self):
        nh, nkv, d = self.heads
        return self.batch * self.seq_len * nkv * d * 2 * self.key_cache.element_size()


def sdpa(q, k, v, scale):
    """q [B, Hq, D] -> [B, Hq, D] via SDPA on [B, H, 1, D] x [B, Hkv, S, D] with enable_gqa."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


EMULATED = False  # --emulation: our kernels run on CPU tensors through the emulation library


def uses_kernels(device: str) -> bool:
    return device != "cpu" or EMULATED


def current_stream(device: str) -> int:
    return torch.cuda.current_stream().cuda_stream if device != "cpu" else 0


def set_kernel(device: str, variant: str) -> None:
    """Select a VARIANTS entry (or a plain kernel name with default options)."""
    if uses_kernels(device):
        from trtllm_lite import cuda as tlcuda
        kernel, prefetch = VARIANTS.get(variant, (variant, -1))
        tlcuda.set_decode_kernel(kernel)
        tlcuda.set_decode_mma_prefetch(prefetch)


def make_ours(case: PagedCase, dtype_name: str, device: str, workspace):
    """Callables launching our decode for each rotation (torch stand-in with --dry-run)."""
    nh, nkv, d = case.heads
    scale = d ** -0.5
    if not uses_kernels(device):
        def stand_in(r):
            k, v = case.contiguous_kv(r)
            case.out.copy_(sdpa(case.query[r], k, v, scale))
        return [lambda r=r: stand_in(r) for r in range(len(case.query))]
    from trtllm_lite import cuda as tlcuda

    def launch(r):
        tlcuda.paged_attention_decode(
            dtype=dtype_name, query=case.query[r].data_ptr(), key_cache=case.key_cache.data_ptr(),
            value_cache=case.value_cache.data_ptr(), out=case.out.data_ptr(),
            block_tables=case.block_tables[r].data_ptr(),
            context_lens=case.context_lens.data_ptr(), num_seqs=case.batch, num_heads=nh,
            num_kv_heads=nkv, head_dim=d, block_size=case.block_size,
            max_blocks_per_seq=case.blocks_per_seq, max_seq_len=case.seq_len, scale=scale,
            workspace=workspace.data_ptr(), workspace_size=workspace.numel(),
            stream=current_stream(device))
    return [lambda r=r: launch(r) for r in range(len(case.query))]


def bench_decode(model, heads, batch, context, args, dtype) -> Row:
    nh, nkv, d = heads
    per_rot = batch * (context + 1) * nkv * d * 2 * 2
    rotations = max(1, min(args.max_rotations, math.ceil(ROTATE_BYTES / per_rot)))
    case = PagedCase(heads, batch, context, args.block_size, dtype, args.device, rotations)
    splits, ws_bytes = 1, 16
    if uses_kernels(args.device):
        from trtllm_lite import cuda as tlcuda
        for variant in VARIANTS:
            set_kernel(args.device, variant)
            ws_bytes = max(ws_bytes, tlcuda.decode_workspace_size(batch, nh, nkv, d, case.seq_len))
        set_kernel(args.device, "mma")
        splits = tlcuda.decode_num_splits(batch, nh, nkv, d, case.seq_len)  # the default's
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=args.device)
    ours = make_ours(case, args.dtype, args.device, workspace)
    # Correctness against the peer on rotation 0, every variant (worst error reported).
    k0, v0 = case.contiguous_kv(0)
    ref = sdpa(case.query[0], k0, v0, d ** -0.5).float()
    rel_err = 0.0
    for variant in VARIANTS:
        set_kernel(args.device, variant)
        case.out.fill_(float("nan"))
        ours[0]()
        rel_err = max(rel_err, ((case.out.float() - ref).norm() / ref.norm()).item())
    peer_kv = [(k0, v0)] + [case.contiguous_kv(r) for r in range(1, rotations)]
    peer = [lambda r=r: sdpa(case.query[r], *peer_kv[r], d ** -0.5) for r in range(rotations)]
    times = {}
    for variant in VARIANTS:
        set_kernel(args.device, variant)
        times[variant] = median_replay_ms(ours, args.reps, args.device) * 1e3
    set_kernel(args.device, "mma")
    sdpa_ms = median_replay_ms(peer, args.reps, args.device)
    row = Row(model, heads, batch, context, case.kv_bytes(), times, sdpa_ms * 1e3, rel_err,
              splits)
    del case, peer_kv, peer, ours, workspace
    return row


def policy_sweep(args, dtype):
    """Decode time at 32k context for a few split policies (tuning aid)."""
    from trtllm_lite import cuda as tlcuda
    lines = ["| model | batch | kernel | min_chunk | ctas/SM (0 = occupancy) | splits | µs | TB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for model, batch in (("Llama-8B-like", 1), ("Llama-8B-like", 16), ("SmolLM2-like", 16)):
        heads = HEAD_CONFIGS[model]
        nh, nkv, d = heads
        case = PagedCase(heads, args.sweep_batch or batch, args.sweep_context, args.block_size,
                         dtype, args.device, 1)
        for kernel in ("mma+prefetch", "mma+direct", "pipelined"):
            set_kernel(args.device, kernel)
            # ctas/SM: resident blocks the plan assumes (0 = the kernel's occupancy, default)
            for min_chunk, ctas in ((256, 0), (256, 1), (256, 2), (256, 3), (256, 8),
                                    (512, 0), (1024, 0)):
                tlcuda.set_decode_policy(min_chunk, ctas)
                splits = tlcuda.decode_num_splits(case.batch, nh, nkv, d, case.seq_len)
                ws = torch.empty(max(16, tlcuda.decode_workspace_size(case.batch, nh, nkv, d,
                                                                      case.seq_len)),
                                 dtype=torch.uint8, device=args.device)
                ms = median_replay_ms(make_ours(case, args.dtype, args.device, ws), args.reps,
                                      args.device)
                lines.append(f"| {model} | {case.batch} | {kernel} | {min_chunk} | {ctas} | {splits} "
                             f"| {ms * 1e3:.1f} | {case.kv_bytes() / ms / 1e9:.2f} |")
        del case
    tlcuda.set_decode_policy(0, 0)
    set_kernel(args.device, "mma")
    return lines


def bench_prefill(args, dtype):
    """Causal prefill of a fresh prompt (ctx 0) and of a chunk after a cached context."""
    from trtllm_lite import cuda as tlcuda
    nh, nkv, d = HEAD_CONFIGS["Llama-8B-like"]
    lines = ["| context | chunk | ours ms | ours TFLOP/s | SDPA (causal, fresh prompt) ms | "
             "rel err vs SDPA |", "|---|---|---|---|---|---|"]
    for ctx, qlen in args.prefill_cases:
        bs = args.block_size
        nblk = -(-(ctx + qlen) // bs)
        kc = torch.randn(nblk, bs, nkv, d, dtype=dtype, device=args.device)
        vc = torch.randn_like(kc)
        bt = torch.randperm(nblk, device=args.device).view(1, -1)
        q = torch.randn(qlen, nh, d, dtype=dtype, device=args.device)
        out = torch.empty_like(q)
        cl = torch.tensor([ctx], dtype=torch.int64, device=args.device)
        qsl = torch.tensor([0, qlen], dtype=torch.int64, device=args.device)

        def launch():
            tlcuda.paged_attention_prefill(
                dtype=args.dtype, query=q.data_ptr(), key_cache=kc.data_ptr(),
                value_cache=vc.data_ptr(), out=out.data_ptr(), block_tables=bt.data_ptr(),
                context_lens=cl.data_ptr(), query_start_loc=qsl.data_ptr(), num_seqs=1,
                num_tokens=qlen, max_query_len=qlen, num_heads=nh, num_kv_heads=nkv, head_dim=d,
                block_size=bs, max_blocks_per_seq=nblk, scale=d ** -0.5,
                stream=current_stream(args.device))
        ms = median_replay_ms([launch], args.reps, args.device)
        flops = 4 * nh * d * qlen * (ctx + (qlen + 1) / 2)  # QK^T and PV over visible keys
        peer, err = "-", "-"
        if ctx == 0:  # the same prompt through SDPA on a contiguous copy of its K/V
            qq = q.transpose(0, 1).unsqueeze(0)
            kk = kc[bt[0]].flatten(0, 1)[:qlen].transpose(0, 1).unsqueeze(0).contiguous()
            vv = vc[bt[0]].flatten(0, 1)[:qlen].transpose(0, 1).unsqueeze(0).contiguous()
            attend = lambda: F.scaled_dot_product_attention(  # noqa: E731
                qq, kk, vv, is_causal=True, enable_gqa=True)
            pm = median_replay_ms([attend], args.reps, args.device)
            peer = f"{pm:.3f}"
            out.fill_(float("nan"))
            launch()
            ref = attend()[0].transpose(0, 1).float()
            err = f"{((out.float() - ref).norm() / ref.norm()).item():.1e}"
        lines.append(f"| {ctx} | {qlen} | {ms:.3f} | {flops / ms / 1e9:.1f} | {peer} | {err} |")
    return lines


def render(rows, copy_bw, read_bw, args, extra):
    gpu = torch.cuda.get_device_name() if args.device != "cpu" else "CPU (dry run)"
    bound = copy_bw / 1e12
    names = list(VARIANTS)
    out = [f"GPU: {gpu}; torch {torch.__version__}; dtype {args.dtype}; block_size "
           f"{args.block_size}; measured device copy bandwidth (read + write): {bound:.2f} TB/s; "
           f"read bandwidth (sum): {read_bw / 1e12:.2f} TB/s.",
           "",
           "Decode kernel variants (µs): mma = tensor cores with (+prefetch) and without "
           "(+direct) loading the next 16 positions while computing; pipelined and registers = "
           "CUDA cores. The default is mma, +prefetch at head_dim 128 and +direct at 64; "
           "best = the fastest; speed-up = SDPA time / best; splits = the default's.",
           "",
           "| model (q/kv/d) | batch | context | K/V MiB | splits | " + " | ".join(names) +
           " | best TB/s | % of copy bw | SDPA µs | SDPA TB/s | speed-up vs SDPA | "
           "rel err vs SDPA |",
           "|" + "---|" * (len(names) + 11)]
    for r in rows:
        best = min(r.times_us.values())
        best_bw = r.kv_bytes / (best * 1e-6) / 1e12
        sdpa_bw = r.kv_bytes / (r.sdpa_us * 1e-6) / 1e12
        cells = " | ".join(f"{r.times_us[n]:.1f}" for n in names)
        out.append(f"| {r.model} ({'/'.join(map(str, r.heads))}) | {r.batch} | {r.context} | "
                   f"{r.kv_bytes / 2**20:.1f} | {r.splits} | {cells} | {best_bw:.2f} | "
                   f"{100 * best_bw / bound:.0f}% | {r.sdpa_us:.1f} | {sdpa_bw:.2f} | "
                   f"{r.sdpa_us / best:.2f}x | {r.rel_err:.1e} |")
    return "\n".join(out + [""] + extra) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-rotations", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="*", default=CONTEXTS)
    ap.add_argument("--batches", type=int, nargs="*", default=BATCHES)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, torch stand-in")
    ap.add_argument("--emulation", type=Path, default=None,
                    help="CPU, tiny sizes, kernels from this emulation library")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.dry_run or args.emulation else "cuda"
    args.sweep_context, args.sweep_batch = 32768, 0
    args.prefill_cases = ((0, 4096), (8192, 512))
    if args.device == "cpu":
        args.contexts, args.batches, args.reps, args.max_rotations = [64, 200], [1, 3], 2, 2
        args.sweep_context, args.sweep_batch = 700, 2
        args.prefill_cases = ((0, 100), (300, 40))
        args.no_sweep = not args.emulation
    if args.emulation:
        global EMULATED
        EMULATED = True
        from trtllm_lite import cuda as tlcuda
        tlcuda.use_library(args.emulation)
    elif args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_cuda_attention: no CUDA device (use --dry-run to test the plumbing)")
    dtype = getattr(torch, args.dtype)
    copy_bw, read_bw = copy_bandwidth(args.device)
    rows = []
    for model, heads in HEAD_CONFIGS.items():
        for context in args.contexts:
            for batch in args.batches:
                row = bench_decode(model, heads, batch, context, args, dtype)
                rows.append(row)
                times = ", ".join(f"{n} {us:.1f}" for n, us in row.times_us.items())
                print(f"{model} b{batch} ctx{context}: {times} µs; sdpa {row.sdpa_us:.1f} µs, "
                      f"err {row.rel_err:.1e}", flush=True)
    if args.device != "cpu":
        for model, heads, batch, context in DIAGNOSTIC_CASES:
            rows.append(bench_decode(model, heads, batch, context, args, dtype))
            print(f"{model} b{batch} ctx{context}: " + ", ".join(
                f"{n} {us:.1f}" for n, us in rows[-1].times_us.items())
                + f" µs; sdpa {rows[-1].sdpa_us:.1f} µs", flush=True)
    extra = []
    if not args.no_sweep:
        extra += ["Decode split policy sweep (Llama-8B-like, context 32k):", ""]
        extra += policy_sweep(args, dtype) + [""]
        extra += [f"Prefill (Llama-8B-like heads, {args.dtype}):", ""] + bench_prefill(args, dtype)
    text = render(rows, copy_bw, read_bw, args, extra)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
