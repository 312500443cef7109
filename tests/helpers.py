"""Synthetic profiles for specification tests (no torch needed)."""

from __future__ import annotations

import pandas as pd

from pipesim.profile import Profile


def uniform_profile(n_layers: int, *, fwd_s: float = 1.0, bwd_s: float = 2.0,
                    sizes: tuple[int, ...] = (1, 64), act_bytes: int = 100,
                    saved_bytes: int = 300, param_bytes: int = 1000) -> Profile:
    """Every layer costs ``fwd_s``/``bwd_s`` *per sample* and bytes per sample.

    Times and bytes scale linearly with the micro-batch size, so a stage of ``k`` layers on
    ``b`` samples costs ``k * b * fwd_s`` forward.  The layer saves its input (``act_bytes``
    per sample) plus internals; it does not save its output.
    """
    rows = []
    for layer in range(n_layers):
        for b in sizes:
            rows.append(dict(layer=layer, name="Uniform", micro_batch=b, fwd_s=fwd_s * b,
                             bwd_s=bwd_s * b, input_bytes=act_bytes * b,
                             output_bytes=act_bytes * b, saved_bytes=saved_bytes * b,
                             saved_input_bytes=act_bytes * b, saved_output_bytes=0,
                             param_bytes=param_bytes))
    return Profile(pd.DataFrame(rows), meta={"device": "synthetic"})
