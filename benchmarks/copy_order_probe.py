"""Does a small device-to-host read wait for a large copy out queued on another stream?

It does on the H200 we measured: the copy engine serves device-to-host copies in order. So a loss
``.item()`` right after the optimizer step waits for the state's copy out (see docs/offload.md).

    python benchmarks/copy_order_probe.py
"""

from __future__ import annotations

import time

import torch

from megatron_offload.host_memory import HostSlab

NBYTES = 2_400_000_000  # about the long-forward benchmark shape's state


def main() -> None:
    slab = HostSlab(NBYTES, torch.uint8, pin=True)  # keep the object: the slab unpins when dropped
    host, device = slab.tensor, torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    small = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    for pieces in (1, 38, 38, 150):
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        size = NBYTES // pieces
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for i in range(pieces):
                host[i * size : (i + 1) * size].copy_(device[i * size : (i + 1) * size], non_blocking=True)
        queued = time.perf_counter()
        small.sum().item()
        read = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        print(
            f"copy out in {pieces} pieces: queued in {1e3 * (queued - start):.1f} ms, a 4-float .item() took "
            f"{1e3 * (read - queued):.1f} ms, all done after {1e3 * (done - start):.1f} ms"
        )


if __name__ == "__main__":
    main()
