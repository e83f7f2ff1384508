"""Host-memory drills on a GPU machine (the CPU suite runs the same in tests/test_host_memory.py):

    python tests/gpu/host_memory_drill.py --out results/host-memory     # exit 0 when every drill passed

1. pinning works here (a HostSlab of 256 MiB is pinned);
2. pinning refused (cudaHostRegister answers 2): a warning with the pageable and pinned rates measured
   on this GPU, or with ``on_pin_failure="raise"`` a HostMemoryError;
3. the same refusal in Megatron-LM's loop (scripts/pretrain_gpt.py, configs/tiny.yaml, 5 iterations):
   the run completes, its log carries the warning;
4. a node too small for every rank, in Megatron-LM's loop: the real MemAvailable, as if 4096 ranks
   shared this node: the run stops before iteration 1 with the HostMemoryError.
Each Megatron run is this file again under torchrun with ``--megatron DRILL``, which makes the change
(on module attributes, not in library code) and then runs pretrain_gpt.main().
"""

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
TINY = ["--config", "configs/tiny.yaml", "--train-iters", "5", "--offload-optimizer-states"]


def refuse_pinning(data_ptr: int, nbytes: int) -> int:
    return 2  # cudaErrorMemoryAllocation


def slab_drills() -> dict[str, str]:
    """Failures by drill name ('' when it passed)."""
    import torch

    from megatron_offload import HostMemoryError, host_memory

    results = {}
    slab = host_memory.HostSlab(256 * 2**20, torch.uint8, pin=True)
    results["pinned"] = "" if slab.pinned else "a 256 MiB slab was not pinned on this machine"
    slab.release()
    host_memory._pin = refuse_pinning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host_memory.HostSlab(1024 * 2**20, torch.uint8, pin=True)
    message = " ".join(str(w.message) for w in caught)
    print(f"pin refused: {message}", flush=True)
    results["pin-refused-warns"] = "" if "Measured here" in message else f"no measured cost in: {message!r}"
    try:
        host_memory.HostSlab(1024 * 2**20, torch.uint8, pin=True, on_pin_failure="raise")
        results["pin-refused-raises"] = "no HostMemoryError"
    except HostMemoryError as error:
        print(f"pin refused, raise: {error}", flush=True)
        results["pin-refused-raises"] = "" if "could not pin 1.00 GiB" in str(error) else f"message: {error}"
    return results


def megatron_drill(name: str, out: Path) -> str:
    """Run one drill through Megatron-LM's loop; '' when it behaved as expected."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command += [__file__, "--megatron", name, *TINY]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = result.stdout + result.stderr
    (out / f"host-memory-{name}.log").write_text(text)
    if name == "pin-refused":
        if result.returncode != 0:
            return f"exited {result.returncode}"
        if "using pageable memory instead" not in text or " iteration        5/" not in text:
            return "no pin warning, or the run did not reach iteration 5"
        return ""
    stopped = result.returncode != 0 and "HostMemoryError" in text and "x 4096 rank(s) on this node" in text
    if not stopped or " iteration        1/" in text:
        return f"expected a HostMemoryError before iteration 1 (exit {result.returncode})"
    return ""


def run_in_megatron(name: str) -> None:
    from megatron_offload import host_memory

    if name == "pin-refused":
        host_memory._pin = refuse_pinning
    elif name == "node-too-small":
        host_memory.ranks_on_this_node = lambda: 4096  # the real MemAvailable, shared as if by 4096 ranks
    import pretrain_gpt  # expands --config in sys.argv

    pretrain_gpt.main()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--megatron":
        name = sys.argv[2]
        sys.argv[1:] = sys.argv[3:]
        run_in_megatron(name)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "host-memory-results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = slab_drills()
    for name in ("pin-refused", "node-too-small"):
        results[f"megatron-{name}"] = megatron_drill(name, args.out)
    (args.out / "host-memory.json").write_text(json.dumps(results, indent=1))
    for name, failure in results.items():
        print(f"{name:28} {'ok' if not failure else 'FAIL: ' + failure}")
    return 0 if not any(results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
