"""Draft models for speculative decoding made from the target itself (early exit).

``--draft-layers N`` keeps the first N decoder layers, the final norm and the LM head
(self-speculative decoding through early exit; Zhang et al. 2023, "Draft & Verify"). The
draft shares the target's tokenizer and vocabulary, and is an ordinary engine.
"""
from __future__ import annotations

import dataclasses

from .loaders import LoadedModel


def keep_first_layers(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """A copy of ``loaded`` with only layers ``0 .. num_layers - 1``.

    Raises:
        ValueError: ``num_layers`` is not in ``[1, model layers)``.
    """
    total = loaded.config.num_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"--draft-layers must be in [1, {total - 1}] for this {total}-layer model, got {num_layers}")
    keep = {name: w for name, w in loaded.weights.items()
            if not name.startswith("layers.") or int(name.split(".")[1]) < num_layers}
    config = dataclasses.replace(loaded.config, num_layers=num_layers)
    return dataclasses.replace(loaded, config=config, weights=keep,
                               extra=dict(loaded.extra, draft_of_layers=total))
