"""Expert-load pictures: how often each expert of each layer was chosen.

    python -m routing_replay.plot build/routing_out/*.npy -o load.png

draws, from ``[T, L, K]`` routing arrays (``.npy`` files, directories of them, numpy arrays, or a
live :class:`routing_replay.Replay` with request ids), a layer x expert heatmap of each expert's
load (its share of its layer's choices relative to a uniform router's ``1 / E``: 1 is uniform, 2
is twice its share) and a bar chart of the most loaded (layer, expert) pairs. Rows never recorded (the sentinel) are left out. Needs matplotlib
(``pip install routing-replay[plot]``); :func:`expert_load` itself needs numpy only.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["expert_load", "load_arrays", "plot_expert_load", "plot_replay", "main"]


def load_arrays(sources: Iterable) -> list[np.ndarray]:
    """Routing arrays from ``.npy`` paths, directories (every ``*.npy`` inside) and arrays."""
    arrays = []
    for source in sources:
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            paths = sorted(glob.glob(os.path.join(path, "*.npy"))) if os.path.isdir(path) else [path]
            arrays += [np.load(p, allow_pickle=False) for p in paths]
        else:
            arrays.append(np.asarray(source))
    for a in arrays:
        if a.ndim != 3:
            raise ValueError(f"routing arrays are [T, L, K], got shape {a.shape}")
    return arrays


def expert_load(arrays: Sequence[np.ndarray], num_experts: int | None = None) -> np.ndarray:
    """Counts ``[L, E]``: how many times each expert of each layer was chosen over all rows.

    The sentinel (-1, or the unsigned maximum) and ids outside ``[0, num_experts)`` are not
    counted. ``num_experts`` defaults to one past the largest id seen.
    """
    if not arrays:
        raise ValueError("no routing arrays")
    layers = {a.shape[1] for a in arrays}
    if len(layers) != 1:
        raise ValueError(f"arrays with different layer counts: {sorted(layers)}")
    ids = [a.reshape(-1, a.shape[1], a.shape[2]).astype(np.int64) for a in arrays]
    valid = []
    for a, original in zip(ids, arrays):
        info = np.iinfo(original.dtype)
        sentinel = -1 if info.min < 0 else info.max
        valid.append(np.where(a == sentinel, -1, a))
    if num_experts is None:
        num_experts = max(int(v.max(initial=-1)) for v in valid) + 1
    L = layers.pop()
    counts = np.zeros((L, max(num_experts, 1)), dtype=np.int64)
    for v in valid:
        for layer in range(L):
            chosen = v[:, layer, :].ravel()
            chosen = chosen[(chosen >= 0) & (chosen < num_experts)]
            counts[layer] += np.bincount(chosen, minlength=num_experts)[:num_experts]
    return counts


def plot_expert_load(sources, output: str | os.PathLike | None = None, *, num_experts: int | None = None,
                     top: int = 12, title: str | None = None, layer_names: Sequence[str] | None = None):
    """Draws the picture; saves it to `output` when given; returns the matplotlib figure."""
    import matplotlib

    if output is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    arrays = load_arrays(sources)
    counts = expert_load(arrays, num_experts)
    L, E = counts.shape
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    load = share * E  # relative to a uniform router: 1 means 1/E of the layer's choices
    rows = sum(a.shape[0] for a in arrays)

    fig, (heat, bars) = plt.subplots(1, 2, figsize=(13, min(0.09 * L + 3.2, 9)),
                                     gridspec_kw={"width_ratios": [3, 1.3]})
    image = heat.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    heat.set_xlabel("expert")
    heat.set_ylabel("MoE layer")
    ticks = np.arange(0, L, max(1, L // 16))
    heat.set_yticks(ticks, [layer_names[t] for t in ticks] if layer_names is not None else ticks)
    fig.colorbar(image, ax=heat, label="load (1 = uniform, 1/E of the layer's choices)", fraction=0.04)
    heat.set_title(f"expert load per layer ({rows} tokens, {len(arrays)} requests, top-{arrays[0].shape[2]} of {E})")

    flat = np.argsort(-load, axis=None, kind="stable")[: min(top, load.size)]
    layer_of, expert_of = np.unravel_index(flat, load.shape)
    values = load[layer_of, expert_of]
    labels = [f"layer {l} / expert {e}" for l, e in zip(layer_of, expert_of)]
    bars.barh(range(len(flat)), values, color="tab:orange")
    bars.set_yticks(range(len(flat)), labels)
    bars.invert_yaxis()
    bars.axvline(1.0, color="k", linestyle="--", linewidth=1, label="uniform")
    low = min(1.0, float(values.min(initial=1.0)))
    high = float(values.max(initial=1.0))
    margin = 0.05 * (high - low) + 0.005
    bars.set_xlim(low - margin, high + margin)
    bars.set_xlabel("load (1 = uniform)")
    bars.set_title(f"{len(flat)} most loaded experts")
    bars.legend(loc="lower right", framealpha=0.9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if output is not None:
        fig.savefig(output, dpi=110)
    return fig


def plot_replay(replay, request_ids: Iterable, output: str | os.PathLike | None = None, **kwargs):
    """:func:`plot_expert_load` of live requests of a :class:`routing_replay.Replay` (copies their rows)."""
    arrays = [replay.extract(rid, copy=True) for rid in request_ids]
    kwargs.setdefault("num_experts", replay.config.num_experts)
    return plot_expert_load(arrays, output, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m routing_replay.plot FILES... -o load.png``."""
    parser = argparse.ArgumentParser(prog="python -m routing_replay.plot",
                                     description="Draw per-layer expert load from [T, L, K] routing .npy files.")
    parser.add_argument("files", nargs="+", help=".npy files or directories of them")
    parser.add_argument("-o", "--output", default="expert_load.png", help="the picture (PNG, SVG, PDF...)")
    parser.add_argument("--num-experts", type=int, default=None, help="E (default: one past the largest id)")
    parser.add_argument("--top", type=int, default=12, help="most loaded experts to list")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        plot_expert_load(args.files, args.output, num_experts=args.num_experts, top=args.top, title=args.title)
    except ImportError:
        print("routing_replay.plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
