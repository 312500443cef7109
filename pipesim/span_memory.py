"""What a span of layers keeps and holds in memory, in bytes, from a Profile's columns.

A stage is a span of consecutive layers.  :meth:`pipesim.profile.Profile.span_cost`
reads the profile's columns for the span at one micro-batch size (``cols``: column name
-> one value per layer of the span, bytes) and asks this module three things:

* what a micro-batch keeps from its forward to its backward (:func:`stash_bytes`),
  each tensor once: a boundary tensor saved by the layer that made it and by the layer
  that reads it is one storage;
* what a split backward's ``I`` leaves for its ``W`` (:func:`w_pending_bytes`);
* what each pass holds above that while it runs (:func:`pass_rises`): the forward's and
  the recomputation's rises, the backward's walked layer by layer, and a stage's first
  backward's, beside its weight gradients.

A span of layers i..j and its passes' rises above what the span keeps::

    forward   layer i  [kept before i | input | output + saved | temporaries]
    backward  layer j  [temporaries | input gradient made | output gradient used]
                       less what the layers behind j already freed

Skip connections shape the walk: a Stash layer passes its input on as its output
(saving nothing, :func:`stash_flags`), a Pop layer joins its skip to its input (a new
tensor; its input gradient is a view of what it receives).  Plain data in, floats out:
no torch, no Profile.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np


def stash_flags(first: int, cols: dict[str, np.ndarray], pass_through: Collection[int]) -> list[bool]:
    """Per layer of a span starting at ``first`` (``cols``: its columns at one size):
    whether it is a Stash layer that passes its input on as its output, saving nothing
    (a layer of ``pass_through``, the profile's Stash layers, whose forward saved
    nothing)."""
    s_in, s_out = cols["saved_input_bytes"], cols["saved_output_bytes"]
    return [first + j in pass_through and s_in[j] == 0 and s_out[j] == 0
            for j in range(len(s_in))]


def stash_bytes(cols: dict[str, np.ndarray], through: list[bool],
                loss_span: bool) -> tuple[float, float]:
    """``(stash_bytes, output_saved_bytes)`` of a span (``cols``: its columns at one
    size, ``through``: :func:`stash_flags`, ``loss_span``: whether it ends in the loss):
    what a micro-batch keeps from its forward to its backward, each tensor once, and
    the part of the span's output its layers saved (a recomputation makes it anew)."""
    saved = cols["saved_bytes"]
    s_in, s_out = cols["saved_input_bytes"], cols["saved_output_bytes"]
    n = len(saved)
    # Inner boundaries: output of layer i is the input of layer i+1, one storage --
    # also across a Stash layer, which passes its input on as its output (saving
    # nothing): layer i's output is then layer i+2's input.
    shared = np.minimum(s_out[:-1], s_in[1:]).sum() if n > 1 else 0.0
    for k in range(1, n - 1):
        if through[k]:
            shared += min(s_out[k - 1], s_in[k + 1])
    # The stage output stays alive until its backward (autograd holds it for the
    # gradient that arrives from the next stage), saved or not -- unless the span ends
    # in the loss: then its output is the loss, and the last layer's output (logits)
    # lives on only as far as the loss saved it.
    # (a span that ends in Stash layers outputs the tensor of the layer before them:
    # saved there, it is in the stash already)
    last = n - 1
    while last > 0 and through[last]:
        last -= 1
    stash = saved.sum() - shared - (0.0 if loss_span
                                    else s_out[last] - cols["output_bytes"][-1])
    return float(stash), 0.0 if loss_span else float(s_out[last])


def w_pending_bytes(first: int, cols: dict[str, np.ndarray]) -> float:
    """The bytes a split backward's ``I`` keeps alive for its ``W`` (see
    :attr:`pipesim.profile.LayerCost.w_pending_bytes`): none on the first stage, whose
    input is data."""
    if first == 0:
        return 0.0
    if "w_pending_bytes" in cols and "w_received_bytes" in cols:
        # measured: each layer's own, and the inner layers' received gradients
        return float(cols["w_pending_bytes"].sum() + cols["w_received_bytes"][:-1].sum())
    # the output gradients of the inner layers with weights
    weighted = cols["param_bytes"][:-1] > 0
    return float(cols["output_bytes"][:-1][weighted].sum())


def pass_rises(first: int, cols: dict[str, np.ndarray], through: list[bool], loss_span: bool,
               pops: frozenset[int]) -> dict[str, float]:
    """What a span holds above its kept bytes while its passes run, as
    :class:`pipesim.profile.LayerCost` fields (bytes): the forward's and the
    recomputation's rises, the backward's (walked layer by layer, :func:`backward_rise`),
    a checkpointed backward's after recomputing, and a stage's first backward's, whose
    weight gradients stay beside it (``pops``: the profile's Pop layers).  Needs the
    profile's transient columns."""
    saved = cols["saved_bytes"]
    raw = "bwd_rise_bytes" in cols and "bwd_fed_rise_bytes" in cols
    # the stage's input gradient, which the simulator holds from the backward's
    # start (it is handed on at its end); measured rises place it where it is
    # made, at the first layer's backward, so what runs before (the recomputation,
    # the inner layers) holds that much less beside it
    early = float(cols["input_bytes"][0]) if raw and first > 0 else 0.0
    own = own_saved(cols, through)
    fwd_rise = forward_rise(cols, through, own)
    inside = fwd_rise[:-1] if loss_span else fwd_rise
    # (torch.utils.checkpoint stops its recomputation once the last tensor the
    # forward saved is made again: layers after the last that saves are not re-run)
    savers = np.nonzero(saved[:len(inside)] > 0)[0]
    inside = inside[:savers[-1] + 1] if len(savers) else inside[:0]
    # the backward of layer i runs after the layers behind it freed what they saved
    # (measured raw rises: a layer's saved input that its producer saved too goes
    # in the producer's backward, which the producer's rise is net of)
    freed_after = np.concatenate(
        [np.cumsum((own if raw else saved)[::-1])[::-1][1:],
         [0.0]])
    net = backward_rise(first, cols, through, pops, loss_span) - freed_after
    net[1:] -= early
    body = net
    if loss_span:
        # the loss's gradient (the logits'), which the simulator holds from the
        # start too, is gone once the last layer's backward is done: the layers
        # before it hold that much less beside it.  (Not so after a recomputation,
        # by the grid's checkpointed loss stages: 0.3% / 1.1% under with it.)
        net = net.copy()
        net[:-1] -= cols["output_bytes"][-1]
    if raw and not loss_span:
        # after recomputing (the body is what a checkpointed backward holds)
        body = backward_rise(first, cols, through, pops, recomputed=True) - freed_after
        body[1:] -= early
    if loss_span:
        # the last layer's transient less the loss's own (a gradient the size of
        # its input, the logits): what its layer proper holds, after recomputing
        body = body.copy()
        body[-1] -= cols["output_bytes"][-1]
    # A stage's first backward: the weight gradients of the layers walked before
    # layer j (those after it) stay beside its rise (its own are in the rise,
    # where its peak held them, as temporaries or as .grad alike)
    before = np.cumsum(cols["param_bytes"][::-1])[::-1] - cols["param_bytes"]
    first_peaks = net + before
    if loss_span:  # (the loss's gradient beside the last layer's, as simulated)
        first_peaks[-1] += cols["output_bytes"][-1]
    first_body = max(float((body + before).max()), 0.0)
    if loss_span:
        # (what stays of the loss layer's own is at least its weight gradients
        # being formed: a backward but the stage's first forms them beside .grad)
        body[-1] = max(body[-1], cols["param_bytes"][-1])
    return {"fwd_transient_bytes": float(fwd_rise.max()),
            "bwd_transient_bytes": max(float(net.max()), 0.0),
            "fwd_temp_bytes": float(cols["fwd_transient_bytes"].max()),
            "recompute_rise_bytes": float(inside.max()) - early if len(inside) else 0.0,
            "bwd_transient_body_bytes": max(float(body.max()), 0.0),
            "bwd_first_rise_bytes": max(float(first_peaks.max()), 0.0),
            "bwd_first_body_bytes": first_body}


def producers(through: list[bool]) -> list[int]:
    """Per layer of a span, the layer whose output is its input: the one before,
    across Stash layers (-1: the span's input)."""
    producers = []
    for j in range(len(through)):
        p = j - 1
        while p > 0 and through[p]:
            p -= 1
        producers.append(p)
    return producers


def own_saved(cols: dict[str, np.ndarray], through: list[bool]) -> np.ndarray:
    """Per layer of a span, the bytes its forward saves that no layer before it saved
    (one storage counted once: a layer's saved input is its producer's saved output;
    the first layer's saved input is the span's received input, not counted)."""
    saved, s_in, s_out = cols["saved_bytes"], cols["saved_input_bytes"], cols["saved_output_bytes"]
    own = np.zeros(len(saved))
    for j, p in enumerate(producers(through)):
        received = j == 0 or (p == 0 and through[0])
        own[j] = saved[j] - (s_in[j] if received else min(s_out[p], s_in[j]))
    return own


def forward_rise(cols: dict[str, np.ndarray], through: list[bool],
                 own: np.ndarray) -> np.ndarray:
    """Bytes above the forward's start that a span's forward holds while each of its
    layers runs (one value per layer; ``cols``: the span's columns at one size,
    ``through``: its Stash layers, :func:`stash_flags`; ``own``: what each saves first,
    :func:`own_saved`), its inputs from other devices aside (the simulator holds them
    as received)::

        layer i's forward:  kept by layers before i    (saved, each tensor once:
                                                        :func:`own_saved`)
                          + its input, where no layer before saved it
                          + what it makes and leaves: its output, and what it saves
                            beyond its input and output
                          + its temporaries (``fwd_transient_bytes``)

    The first layer's input is the received buffer (or the data), and a Stash layer
    makes nothing: its output is its input.  A Pop layer's output is new (the skip
    joined to its input), and the layer after it saves it: inside the span, not the
    received buffer."""
    saved, s_in, s_out = cols["saved_bytes"], cols["saved_input_bytes"], cols["saved_output_bytes"]
    kept = np.concatenate([[0.0], np.cumsum(own)[:-1]])
    rise = np.zeros(len(saved))
    for j, p in enumerate(producers(through)):
        loose = 0.0 if p < 0 or through[p] or s_out[p] > 0 else cols["input_bytes"][j]
        made = 0.0 if through[j] else (cols["output_bytes"][j]
                                       + max(saved[j] - s_in[j] - s_out[j], 0.0))
        rise[j] = kept[j] + loose + made + cols["fwd_transient_bytes"][j]
    return rise


def backward_rise(first: int, cols: dict[str, np.ndarray], through: list[bool],
                  pops: frozenset[int], loss_span: bool = False,
                  recomputed: bool = False) -> np.ndarray:
    """Bytes above the backward's start that a span's backward holds while each of its
    layers runs (one value per layer, in the span's order; ``cols``: its columns at
    one size, ``through``: its Stash layers, :func:`stash_flags`), before what the layers
    behind it freed::

        layer i's backward:  its temporaries (weight gradients being formed, ...)
                           + the input gradient it makes, inside the span (the
                             first layer's is the stage's, which the simulator holds)
                           + its output gradient while its first operations use it,
                             where the layer after made it (not the span's last
                             layer: the received gradient, or the loss's, which the
                             simulator holds; nor a layer before a Pop, whose
                             input gradient is a view of what it received)
        a Stash layer:       its skip's gradient summed with the one from the layers
                             after it: a new tensor the size of its input

    Measured, where the profile has the raw rises (``bwd_rise_bytes``: the output
    gradient held; ``bwd_fed_rise_bytes``: it made anew and freed once used).  After a
    recomputation (``recomputed``) the last layer's saved output is a copy, freed in
    its backward, where the profile held the one output.  From
    ``bwd_transient_bytes`` alone (older profiles): a layer's input gradient is counted
    where the profile saw its backward rise above it (the rise less the input gradient,
    floored at 0, cannot tell an input gradient the size of the whole rise from none),
    no output gradient; a Pop layer's input gradient is a view of the gradient it
    receives, nothing new."""
    rise = np.array(cols["bwd_transient_bytes"], dtype=float)
    raw = "bwd_rise_bytes" in cols and "bwd_fed_rise_bytes" in cols
    last = len(rise) - 1
    for j in range(len(rise)):
        if through[j] and j > 0:
            rise[j] = cols["input_bytes"][j]
        elif raw:
            # (its output gradient is made anew by the layer after, but received, or
            # the loss's, on the last layer, and a view of the gradient a Pop after it
            # receives)
            fed = j < last and first + j + 1 not in pops
            own = cols["bwd_fed_rise_bytes"][j] if fed else cols["bwd_rise_bytes"][j]
            if j == last and recomputed and not loss_span and cols["saved_output_bytes"][j]:
                # its saved output is the recomputation's copy, not the stage's output
                # the profile held: it goes in its backward (fed, less the gradient)
                own = min(own, cols["bwd_fed_rise_bytes"][j] - cols["output_bytes"][j])
            if j == 0:  # less the stage's input gradient, as bwd_transient_bytes is
                own -= cols["bwd_rise_bytes"][j] - cols["bwd_transient_bytes"][j]
            if j == last and loss_span:  # less the logits' gradient
                own -= cols["output_bytes"][j]
            rise[j] = max(own, 0.0)
        elif j > 0 and first + j not in pops and rise[j] > 0:
            rise[j] += cols["input_bytes"][j]
    return rise
