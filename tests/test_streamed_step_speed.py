"""benchmarks/streamed_step_speed.py on the CPU: the masters it builds are the parameters megatron-core counts."""

from pathlib import Path

import pytest
import yaml

from benchmarks import streamed_step_speed


@pytest.mark.parametrize(
    ("config", "parameters"),
    [
        ("configs/nightly_memory.yaml", 732_257_280),  # megatron-core's count in the nightly's report (tied)
        ("configs/gpt_0p9b.yaml", 955_132_416),  # megatron-core's count in its runs' logs (untied)
    ],
)
def test_the_shapes_hold_megatron_cores_parameter_count(config: str, parameters: int) -> None:
    shapes = streamed_step_speed.gpt_shapes(yaml.safe_load(Path(config).read_text()))
    count = 0
    for shape in shapes:
        size = 1
        for dim in shape:
            size *= dim
        count += size
    assert count == parameters


def test_without_a_gpu_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(streamed_step_speed.torch.cuda, "is_available", lambda: False)  # as on a machine without
    assert streamed_step_speed.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
