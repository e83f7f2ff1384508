"""How the caching allocator's memory is laid out in a snapshot: where the reserved bytes that hold no tensor
are, and whether a request of a given size could have found room among them.

The snapshot is PyTorch's (``torch.cuda.memory._snapshot()``), as Megatron-LM writes it with
``--record-memory-history --memory-snapshot-path NAME``: at each logged iteration to NAME, and on running out
of memory to ``oom_rank-R_NAME`` in the working directory. Under a cap the offloaded state and the activations
share one expandable segment; a request fails where the free bytes are many blocks, each smaller than it.

    python -m benchmarks.snapshot_layout oom_rank-0_snapshot.pickle [--request-mib 224] [--json OUT]

Per pool (large, small): reserved, allocated and free bytes; the free blocks by size; how many of them could
hold the request; how often free and live blocks alternate. Then the live bytes by the first frame in
Megatron or this project (with ``--record-memory-history``, else "no frames"), and the allocator's last
actions before the snapshot (maps, unmaps, the out-of-memory), where it recorded them.
"""

from __future__ import annotations

import argparse
import collections
import json
import pickle
import sys
from pathlib import Path
from typing import Any

MIB = 1024**2
GIB = 1024**3
PAGES_MIB = (2, 20)  # page sizes an expandable segment may map and unmap in (the driver's; PyTorch's large pool's)
BINS_MIB = (2, 20, 64, 224, 1024)  # free-block size classes: below 2 MiB, 2-20, 20-64, 64-224, 224-1024, above
OURS = ("megatron_offload", "megatron/")


def size_class(nbytes: int) -> str:
    low = 0
    for high in BINS_MIB:
        if nbytes < high * MIB:
            return f"{low}-{high} MiB"
        low = high
    return f">= {low} MiB"


def pools(snapshot: dict[str, Any], request: int) -> dict[str, dict[str, Any]]:
    """Per segment type: reserved, allocated and free bytes, free blocks by size class, the free blocks that
    could hold ``request`` bytes, and the runs of free blocks between live ones."""
    out: dict[str, dict[str, Any]] = {}
    for segment in snapshot.get("segments", []):
        pool = out.setdefault(
            segment.get("segment_type", "large"),
            {"segments": 0, "expandable": 0, "reserved": 0, "allocated": 0, "free": 0, "free_blocks": 0,
             "largest_free": 0, "fit_request": 0, "free_runs": 0, "by_size": collections.Counter(),
             "pinned": dict.fromkeys(PAGES_MIB, 0)},
        )  # fmt: skip
        pool["segments"] += 1
        pool["expandable"] += bool(segment.get("is_expandable"))
        pool["reserved"] += segment.get("total_size", 0)
        previous_free = False
        for block in sorted(segment.get("blocks", []), key=lambda b: b.get("address", 0)):
            free = block.get("state") == "inactive"
            size = block.get("size", 0)
            if not free:
                pool["allocated"] += size
            else:
                pool["free"] += size
                pool["free_blocks"] += 1
                pool["largest_free"] = max(pool["largest_free"], size)
                pool["fit_request"] += size >= request
                pool["by_size"][size_class(size)] += size
                pool["free_runs"] += not previous_free
                offset = block.get("address", 0) - segment.get("address", 0)  # pages count from the segment's start
                for page in PAGES_MIB:
                    pool["pinned"][page] += size - whole_pages(offset, size, page * MIB)
            previous_free = free
    return out


def whole_pages(offset: int, size: int, page: int) -> int:
    """Bytes of ``[offset, offset + size)`` (from its segment's start, where pages start) in whole ``page``-sized
    pages: what unmapping a free block can give back. The rest shares a page with a live block and stays
    reserved however often the allocator retries."""
    first = -(-offset // page) * page
    last = (offset + size) // page * page
    return max(0, last - first)


def first_frame(frames: list[dict[str, Any]]) -> str:
    for frame in frames:
        name = str(frame.get("filename", ""))
        for mark in OURS:
            if mark in name:
                return f"{name[name.find(mark) :]}:{frame.get('line', '?')} {frame.get('name', '')}"
    return "no frames" if not frames else "elsewhere"


def live_by_frame(snapshot: dict[str, Any], top: int = 12) -> list[tuple[str, int, int]]:
    """Live bytes and blocks by the first frame in Megatron or this project, largest first."""
    totals: dict[str, list[int]] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") == "inactive":
                continue
            entry = totals.setdefault(first_frame(block.get("frames", [])), [0, 0])
            entry[0] += block.get("size", 0)
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [(frame, nbytes, count) for frame, (nbytes, count) in ranked]


def last_actions(snapshot: dict[str, Any], count: int = 200) -> dict[str, Any]:
    """The allocator's recorded actions before the snapshot, counted by kind, and its out-of-memory, if any."""
    traces = [event for device in snapshot.get("device_traces", []) for event in device][-count:]
    kinds = collections.Counter(event.get("action", "?") for event in traces)
    oom = next((event for event in reversed(traces) if event.get("action") == "oom"), None)
    return {"actions": dict(kinds), "oom": {key: oom.get(key) for key in ("size", "device_free")} if oom else None}


def report(snapshot: dict[str, Any], request: int) -> tuple[dict[str, Any], str]:
    layout = pools(snapshot, request)
    frames = live_by_frame(snapshot)
    actions = last_actions(snapshot)
    lines = [f"request {request / MIB:.0f} MiB"]
    for name, pool in layout.items():
        lines.append(
            f"{name} pool: {pool['segments']} segment(s) ({pool['expandable']} expandable), reserved "
            f"{pool['reserved'] / GIB:.2f} GiB, allocated {pool['allocated'] / GIB:.2f}, "
            f"free {pool['free'] / GIB:.2f} in "
            f"{pool['free_blocks']} blocks ({pool['free_runs']} runs between live blocks), largest "
            f"{pool['largest_free'] / MIB:.0f} MiB, {pool['fit_request']} could hold the request"
        )
        pinned = ", ".join(f"{nbytes / MIB:.0f} MiB in {page} MiB pages" for page, nbytes in pool["pinned"].items())
        lines.append(f"    free but sharing a page with a live block (never unmapped): {pinned}")
        for size, nbytes in sorted(pool["by_size"].items(), key=lambda item: -item[1]):
            lines.append(f"    free in blocks of {size:>12}: {nbytes / MIB:9.0f} MiB")
    lines.append("live bytes by first frame in Megatron or megatron_offload:")
    lines += [f"  {nbytes / MIB:9.0f} MiB in {count:5d} blocks  {frame}" for frame, nbytes, count in frames]
    lines.append(f"last actions: {actions['actions']}; out of memory: {actions['oom']}")
    figures = {"request_bytes": request, "pools": layout, "live_by_frame": frames, "last_actions": actions}
    return figures, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path, help="a pickle of torch.cuda.memory._snapshot()")
    parser.add_argument("--request-mib", type=float, default=224.0, help="the request that did not fit")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    with args.snapshot.open("rb") as handle:
        snapshot = pickle.load(handle)  # noqa: S301 - a file the user's own training run wrote
    figures, text = report(snapshot, int(args.request_mib * MIB))
    print(text, end="")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
