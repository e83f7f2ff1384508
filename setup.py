from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-offload",
    version="0.1.0",
    description=(
        "Optimizer-state offloading, weight streaming and long-context training for megatron-core, "
        "in pinned host memory"
    ),
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_offload", "megatron_offload.*"]),
    # The library API works with megatron-core 0.14-0.16 on Python 3.10 and later; Megatron-LM's training
    # loop (megatron.training, scripts/train.sh) needs megatron-core >= 0.17, which requires Python >= 3.12.
    python_requires=">=3.10",
    # Checked against 0.16.1 and 0.19.2; a later megatron-core may lay out its optimizer otherwise.
    install_requires=["torch>=2.6", "megatron-core>=0.14,<0.20", "packaging", "pyyaml"],
    # NVIDIA apex is not on PyPI (the PyPI "apex" is an unrelated package): build it from
    # https://github.com/NVIDIA/apex if wanted; nothing here needs it.
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "test": ["pytest==9.2.0", "ruff==0.17.6", "pyyaml", "matplotlib", "rich"],  # CI runs these two: pinned
        "nightly": ["matplotlib", "rich", "pyyaml"],
    },
)
