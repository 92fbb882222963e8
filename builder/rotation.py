"""Rotated activations for w8a8 engines (``--rotate-activations``), after QuaRot.

Per-token int8 activations lose most where a few channels carry values far larger than the
rest: the token's scale follows its largest value, and every other channel keeps few of its
256 levels. An orthogonal rotation of a linear's input, undone in its weight, spreads such
a channel over many (QuaRot: Ashkboos et al. 2024, "QuaRot: Outlier-free 4-bit inference in
rotated LLMs"; SpinQuant: Liu et al. 2024). The model computes the same function in exact
arithmetic; only the roundings move. Two rotations, for the Llama family (RMSNorm):

* **The residual stream** (hidden size d), offline and free at run time: every weight that
  writes to it (the token embedding, o_proj, down_proj, their biases) is multiplied by an
  orthogonal ``Q [d, d]``, and every weight that reads it (q/k/v, gate/up, the lm_head) by
  ``Q`` too, after the RMSNorm weight before it is folded in (the norm's weight becomes ones:
  ``rmsnorm(x Q) = rmsnorm(x) Q`` for orthogonal ``Q``, which an elementwise weight would
  break). The tied embedding / lm_head become two tensors (``E Q`` and ``E diag(g) Q``).
  ``Q`` is the Kronecker product of a random orthogonal matrix (QR of a seeded Gaussian) of
  size d / p and a random-sign Hadamard matrix of size p, the largest power of two dividing d.
* **The down projection's input** (intermediate size I), online: ``silu(gate) * up`` times a
  block-diagonal normalized Hadamard matrix with blocks of b = min(256, the largest power of
  two dividing I), one ``BlockHadamard`` node a layer (:mod:`builder.fused_ops`: the fast
  Walsh-Hadamard transform in the kernel). A random sign per channel goes into up_proj's
  rows; down_proj's weight takes the signs and the Hadamard blocks.

The attention's o_proj input is not rotated. Measured on SmolLM2-135M (docs/quantization.md):
one activation plane's logits move from the float32 engine's about as far as two planes'
without the rotation.
"""
from __future__ import annotations

import dataclasses

import numpy as np

DOWN_ROTATION = "down_rotation.hadamard"   # [b, b] float32: the BlockHadamard nodes' matrix
MAX_DOWN_BLOCK = 256
SEED = 0


def hadamard_matrix(b: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix ``[b, b]`` float64 (symmetric, orthogonal:
    ``H @ H = I``); ``b`` a power of two.

    Raises:
        ValueError: ``b`` is not a power of two.
    """
    if b < 1 or b & (b - 1):
        raise ValueError(f"b must be a power of two, got {b}")
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(b)


def _power_of_two_part(n: int) -> int:
    return n & -n


def residual_rotation(d: int, rng: np.random.Generator) -> np.ndarray:
    """``Q [d, d]`` float64 orthogonal: a random orthogonal matrix of size d / p (Haar: QR of a
    Gaussian, signs fixed by R's diagonal) Kronecker a random-sign Hadamard matrix of size p,
    the largest power of two dividing ``d``."""
    p = _power_of_two_part(d)
    rest = d // p
    q, r = np.linalg.qr(rng.standard_normal((rest, rest)))
    q *= np.sign(np.diag(r))
    return np.kron(q, rng.choice([-1.0, 1.0], p)[:, None] * hadamard_matrix(p))


def down_block(intermediate_size: int) -> int:
    """b, the down projection input's Hadamard block size."""
    return min(MAX_DOWN_BLOCK, _power_of_two_part(intermediate_size))


def rotate_activations(loaded, seed: int = SEED):
    """A copy of ``loaded`` (:class:`builder.loaders.LoadedModel`, the Llama family's canonical
    float32 weights) computing the same function with both rotations folded in (module
    docstring), untied, and ``DOWN_ROTATION`` added for the graphs' ``BlockHadamard`` nodes.

    Raises:
        ValueError: not the Llama family (GPT-2's LayerNorm subtracts the mean, which the
            residual rotation does not commute with).
    """
    c = loaded.config
    if c.family != "llama":
        raise ValueError(f"--rotate-activations: {c.architecture} is not of the Llama family "
                         "(RMSNorm); only those models' activations can be rotated")
    rng = np.random.default_rng(seed)
    q = residual_rotation(c.hidden_size, rng)
    block = down_block(c.intermediate_size)
    signs = rng.choice([-1.0, 1.0], c.intermediate_size)
    h = hadamard_matrix(block)
    src = loaded.weights
    w: dict[str, np.ndarray] = {}

    def f64(name: str) -> np.ndarray:   # one tensor at a time in float64 (the peak: one tensor, not the model)
        return src[name].astype(np.float64)

    def put(name: str, value: np.ndarray) -> None:
        w[name] = value.astype(np.float32)

    def reads(name: str, norm: str) -> np.ndarray:   # W [out, d] after rmsnorm * g: W diag(g) Q
        return (f64(name) * f64(norm)) @ q

    put("lm_head.weight", reads("lm_head.weight" if "lm_head.weight" in src else "embed.weight", "final_norm.weight"))
    put("embed.weight", f64("embed.weight") @ q)
    put("final_norm.weight", np.ones(c.hidden_size))
    for i in range(c.num_layers):
        p = f"layers.{i}."
        put(p + "qkv.weight", reads(p + "qkv.weight", p + "attn_norm.weight"))
        gate_up = reads(p + "gate_up.weight", p + "mlp_norm.weight")
        # down's input x becomes (x * signs) H_blocks: up's rows take the signs (silu(g) * up is
        # linear in up), down's columns the signs and the blocks (H symmetric)
        gate_up[c.intermediate_size:] *= signs[:, None]
        put(p + "gate_up.weight", gate_up)
        put(p + "attn_norm.weight", np.ones(c.hidden_size))
        put(p + "mlp_norm.weight", np.ones(c.hidden_size))
        put(p + "o.weight", q.T @ f64(p + "o.weight"))
        down = f64(p + "down.weight") * signs
        for start in range(0, c.intermediate_size, block):
            down[:, start:start + block] = down[:, start:start + block] @ h
        put(p + "down.weight", q.T @ down)
        for name in (p + "o.bias", p + "down.bias"):   # added to the residual
            if name in src:
                put(name, f64(name) @ q)
        if p + "gate_up.bias" in src:
            bias = f64(p + "gate_up.bias")
            bias[c.intermediate_size:] *= signs
            put(p + "gate_up.bias", bias)
    for name, arr in src.items():   # the rest as it was (qkv biases: on the outputs)
        w.setdefault(name, arr)
    put(DOWN_ROTATION, h)
    config = dataclasses.replace(c, tie_word_embeddings=False)
    return dataclasses.replace(loaded, config=config, weights=w, extra={})
