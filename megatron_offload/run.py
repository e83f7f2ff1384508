"""Run an unmodified Megatron-LM training script with optimizer-state offloading available:

    python -m megatron_offload.run pretrain_gpt.py [--config configs/tiny.yaml] ARGS... --offload-optimizer-states
    torchrun --nproc-per-node 2 -m megatron_offload.run pretrain_gpt.py ...

The offload flags join Megatron's parser, are validated with Megatron's other arguments, and the
offloader is attached to the optimizer Megatron builds. Without --offload-optimizer-states the script
runs exactly as before.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from megatron_offload.launch_config import expand_config_argv
from megatron_offload.megatron_training import MissingMegatronTraining, install_training_hooks

USAGE = "usage: python -m megatron_offload.run SCRIPT [--config FILE.yaml] [SCRIPT ARGS...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    script, *script_args = argv
    if not Path(script).is_file():
        print(f"megatron_offload.run: no such script: {script}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        install_training_hooks()
    except MissingMegatronTraining as error:
        print(f"megatron_offload.run: {error}", file=sys.stderr)
        return 2
    sys.argv = [script, *expand_config_argv(script_args)]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
