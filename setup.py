from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-offload",
    version="0.1.0",
    description="Optimizer-state offloading to pinned host memory for megatron-core's DistributedOptimizer",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_offload", "megatron_offload.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "megatron-core>=0.14", "packaging", "pyyaml"],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "apex": ["apex"],
        "test": ["pytest>=8", "ruff", "pyyaml", "matplotlib", "rich"],
        "nightly": ["matplotlib", "rich", "pyyaml"],
    },
)
