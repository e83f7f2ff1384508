"""Long context in Megatron-LM's own loop on one GPU: what fits under a cap, at what speed, against no
offload where it fits; and the longest sequence each set of flags trains at.

Rows (Megatron-LM's ``pretrain_gpt.py`` through our launcher, full recompute one layer at a time, RoPE,
micro-batch 1, ``--seq-length`` = ``--max-position-embeddings`` = ``--seq``):
- ``new, cap C``: the SDPA spec, ``--chunked-loss``, ``--offload-layer-inputs``, weights and optimizer
  state streamed, under ``--offload-gpu-memory-cap-gib C``;
- ``today, cap C``: weights and state streamed with the local spec and the full logits (what fitted
  before), under the same cap: expected to run out of memory;
- ``no offload``: the same spec, loss and recompute as ``new``, uncapped (needs a GPU large enough);
- with ``--attention local``, ``new`` and ``no offload`` keep megatron-core's local spec (its unfused attention)
  instead of the SDPA spec, both rows alike: the comparison where a model is trained with that spec;
- ``--longest``: each power-of-two sequence from ``--longest MIN MAX``, three iterations, with today's and
  the new flags under the cap: the longest that trains.
Each JSON row keeps ``argv``, ``returncode``, ``parameters``, time, peak reserved memory, the losses and
its ratio to ``no offload``; with ``--link``, each weight-streaming row also its optimizer step beside that
step's floor over the host link measured first (``link_speed.py``).

    python -m benchmarks.long_context --megatron-lm PATH --config configs/gpt_4b.yaml --seq 65536 --cap 24 \\
        [--rows new today base] [--train-iters 6] [--attention sdpa|local] [--longest 16384 131072] [--link] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.link_speed import measured, with_step_floors
from benchmarks.weight_streaming import WEIGHTS, client, ratios, row

SDPA = ["--spec", "megatron_offload.megatron.sdpa_spec", "gpt_layer_spec"]
LONG = ["--chunked-loss", "--offload-layer-inputs", *WEIGHTS]
TODAY = WEIGHTS


def flag_sets(attention: str) -> tuple[list[str], list[str]]:
    """The ``new`` and ``no offload`` rows' flags: the same attention in both (``sdpa`` or megatron-core's
    ``local`` spec, which the config's ``transformer-impl: local`` gives without ``--spec``)."""
    spec = SDPA if attention == "sdpa" else []
    return [*spec, *LONG], [*spec, "--chunked-loss"]


def sequence(seq: int) -> list[str]:
    return [
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--position-embedding-type", "rope",
        "--micro-batch-size", "1", "--no-rope-fusion", "--no-create-attention-mask-in-dataloader",
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, help="folder with Megatron-LM's pretrain_gpt.py")
    parser.add_argument("--config", default="configs/gpt_4b.yaml")
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--cap", type=float, default=24.0, metavar="GIB", help="0: the rows run uncapped")
    parser.add_argument("--rows", nargs="*", default=["new", "today", "base"], choices=["new", "today", "base"])
    parser.add_argument("--train-iters", type=int, default=6)
    parser.add_argument("--global-batch-size", type=int, default=1, help="micro-batches per iteration")
    parser.add_argument("--extra", default="", help="more Megatron flags for every row, as one string")
    parser.add_argument(
        "--attention", choices=["sdpa", "local"], default="sdpa",
        help="the attention of the new and no-offload rows alike: the SDPA spec, or megatron-core's local spec",
    )  # fmt: skip
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="Megatron's --deterministic-mode in every row (attention's backward without atomics): for bitwise rows",
    )
    parser.add_argument("--longest", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    parser.add_argument(
        "--longest-flags", nargs="*", default=["today", "new"], choices=["today", "new"],
        help="which flag sets --longest searches (a search per set, from MIN up)",
    )  # fmt: skip
    parser.add_argument(
        "--link", action="store_true",
        help="measure the host link first (in a process of its own) and give each weight-streaming row its "
        "optimizer step beside that step's floor over it",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("long-context"))
    args = parser.parse_args()
    base = client(args, "long_context")
    if base is None:
        return 2
    batch = ["--global-batch-size", str(args.global_batch_size), "--log-interval", "1", "--timing-log-level", "1"]
    capped = ["--offload-gpu-memory-cap-gib", f"{args.cap:g}"] if args.cap else []  # --cap 0: uncapped
    batch += ["--deterministic-mode"] if args.deterministic else []
    if args.deterministic:  # deterministic cuBLAS needs a fixed workspace; the runs inherit it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    link = measured() if args.link else None  # before the rows: the GPU is free
    results: dict[str, Any] = {}
    tail = [*sequence(args.seq), *batch, "--train-iters", str(args.train_iters)]
    new, no_offload = flag_sets(args.attention)
    rows = {
        "new": (f"new, cap {args.cap:g} GiB", [*new, *capped]),
        "today": (f"today, cap {args.cap:g} GiB", [*TODAY, *capped]),
        "base": ("no offload", no_offload),
    }
    for key in args.rows:
        name, flags = rows[key]
        results[name] = row(f"seq{args.seq}-{key}", [*base, *flags, *tail], args.out) | {"seq": args.seq}
    ratios(results, "no offload")
    if args.longest:
        low, high = args.longest
        for label, flags in (("today", TODAY), ("new", new)):
            if label not in args.longest_flags:
                continue
            seq = low
            while seq <= high:
                tail = [*sequence(seq), *batch, "--train-iters", "3"]  # 3: the configs warm up for 2
                figures = row(f"longest-{label}-{seq}", [*base, *flags, *capped, *tail], args.out)
                results[f"longest {label} {seq}"] = figures | {"seq": seq}
                if figures.get("returncode") != 0:
                    break  # a longer one will not fit either
                seq *= 2
    if link is not None:
        with_step_floors(results, link)
    (args.out / "long-context.json").write_text(json.dumps(results, indent=1, default=str))
    for name, figures in results.items():
        wanted = ("_ms", "_ratio", "_GiB", "_floor", "equal", "error", "returncode")
        shown = {k: figures[k] for k in figures if k.endswith(wanted)}
        print(f"{name}: {json.dumps(shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
