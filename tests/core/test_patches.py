"""Instance patches: what an attach puts on a model or optimizer instance, and that undo takes all of it off."""

from __future__ import annotations

import torch

from megatron_offload.core.patches import InstancePatches


def test_wrap_call_before_and_replace_act_on_the_instance_and_undo_restores_it() -> None:
    patched, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    calls: list[str] = []
    patches = InstancePatches()
    patches.wrap(patched, "forward", lambda original, x: original(x) * 2)
    patches.call_before(patched, "zero_grad", lambda: calls.append("before"))
    patches.replace(patched, "extra_repr", lambda: "replaced")
    patches.hook(patched.register_forward_pre_hook(lambda module, args: calls.append("hook")))
    x = torch.ones(1, 2)
    plain = torch.nn.functional.linear(x, patched.weight, patched.bias)
    assert torch.equal(patched(x), plain * 2)
    patched.zero_grad()
    assert calls == ["hook", "before"] and patched.extra_repr() == "replaced"
    assert "forward" not in vars(other)  # the class and other instances are untouched

    patches.undo()
    calls.clear()
    assert torch.equal(patched(x), plain)
    patched.zero_grad()
    assert calls == [] and patched.extra_repr() != "replaced"
    assert not {"forward", "zero_grad", "extra_repr"} & set(vars(patched))
    patches.undo()  # twice: nothing left to undo, no error
