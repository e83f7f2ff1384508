"""benchmarks/snapshot_layout.py on a snapshot in PyTorch's format, written here: free memory split between live
blocks is counted, classed by size, and held against the request; live bytes go to their first frame."""

from __future__ import annotations

import pickle
from pathlib import Path

from benchmarks import snapshot_layout as layout

MIB = 1024**2


def block(address: int, mib: int, state: str, filename: str = "") -> dict:
    frames = [{"filename": "/site/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
    if filename:
        frames.insert(0, {"filename": filename, "line": 88, "name": "block"})
    return {"address": address * MIB, "size": mib * MIB, "state": state, "frames": frames}


def snapshot() -> dict:
    """One expandable large segment: 64 MiB chunks of state between activations, three free holes of 64 MiB
    and one of 200 MiB, none of them 224 MiB; and a small segment."""
    chunk, act = "/x/megatron_offload/core/streams.py", "/x/megatron/core/transformer/attention.py"
    blocks = [
        block(0, 64, "active_allocated", chunk), block(64, 64, "inactive"), block(128, 224, "active_allocated", act),
        block(352, 64, "inactive"), block(416, 64, "inactive"), block(480, 64, "active_allocated", chunk),
        block(544, 200, "inactive"), block(744, 24, "active_allocated"),
    ]  # fmt: skip
    return {
        "segments": [
            {"segment_type": "large", "is_expandable": True, "total_size": 768 * MIB, "blocks": blocks},
            {
                "segment_type": "small",
                "is_expandable": True,
                "total_size": 2 * MIB,
                "blocks": [block(2000, 1, "active_allocated"), block(2001, 1, "inactive")],
            },
        ],  # fmt: skip
        "device_traces": [
            [
                {"action": "segment_map"},
                {"action": "segment_unmap"},
                {"action": "oom", "size": 224 * MIB, "device_free": 0},
            ]
        ],  # fmt: skip
    }


def test_free_memory_between_live_blocks_is_counted_against_the_request(tmp_path: Path, capsys) -> None:
    figures, text = layout.report(snapshot(), 224 * MIB)
    large = figures["pools"]["large"]
    assert large["reserved"] == 768 * MIB and large["allocated"] == 376 * MIB and large["free"] == 392 * MIB
    assert large["free_blocks"] == 4 and large["free_runs"] == 3  # two adjacent holes are one run
    assert large["largest_free"] == 200 * MIB and large["fit_request"] == 0  # room in total, none in one piece
    assert large["by_size"] == {"64-224 MiB": 392 * MIB}
    assert figures["pools"]["small"]["free"] == 1 * MIB
    by_frame = {frame.split(":")[0]: (nbytes, count) for frame, nbytes, count in figures["live_by_frame"]}
    assert by_frame["megatron_offload/core/streams.py"] == (128 * MIB, 2)
    assert by_frame["megatron/core/transformer/attention.py"] == (224 * MIB, 1)
    assert figures["last_actions"]["oom"] == {"size": 224 * MIB, "device_free": 0}
    assert "0 could hold the request" in text
    path = tmp_path / "oom_rank-0_snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    assert layout.main([str(path), "--request-mib", "64", "--json", str(tmp_path / "layout.json")]) == 0
    assert "4 could hold the request" in capsys.readouterr().out  # every 64 MiB hole holds 64 MiB
    assert (tmp_path / "layout.json").is_file()


def test_free_bytes_sharing_a_page_with_a_live_block_are_counted_per_page_size() -> None:
    figures, text = layout.report(snapshot(), 224 * MIB)
    pinned = figures["pools"]["large"]["pinned"]
    assert pinned[2] == 0  # every hole starts and ends on a 2 MiB boundary
    # 20 MiB pages: the hole at 64-128 MiB keeps 64-80 and 120-128, 352-416 keeps 352-360 and 400-416,
    # 416-480 keeps 416-420, 544-744 keeps 544-560 and 740-744
    assert pinned[20] == ((16 + 8) + (8 + 16) + 4 + (16 + 4)) * MIB
    assert layout.whole_pages(5 * MIB, 10 * MIB, 2 * MIB) == 8 * MIB  # 6-14 MiB
    assert "72 MiB in 20 MiB pages" in text
    # Pages start where the segment starts: the same layout 10 MiB further on pins the same bytes.
    moved = snapshot()
    large = moved["segments"][0]
    large["address"] = 10 * MIB
    for entry in large["blocks"]:
        entry["address"] += 10 * MIB
    assert layout.report(moved, 224 * MIB)[0]["pools"]["large"]["pinned"] == pinned
