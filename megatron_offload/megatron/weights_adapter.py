"""Every touch of megatron-core for weight streaming. Checked against megatron-core 0.19.2.

What it relies on:
- DDP (``distributed.DistributedDataParallel``) keeps each model chunk's params and fp32 gradients in
  flat buffers, ``chunk.buffers[i].param_data`` / ``.grad_data``, one index space, ``param_index_map``
  giving each param's (start, end); ``param.data`` and ``param.main_grad`` are views into them. Built
  inside ``MappedPool.allocating()`` those buffers live in host memory and every megatron-core path
  that touches them (zeroing, the gradient norm and clipping, the optimizer's copies, checkpointing)
  stays correct; the streamer gives the layers' kernels GPU copies instead.
- DDP's backward hook adds ``param.grad`` into whatever ``param.main_grad`` is when it fires.
- Under ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`` every
  ``TransformerLayer`` runs once without grad (forward) and once with grad (recompute, in backward);
  it is called with keyword arguments, ``hidden_states`` first.
- ``chunk.zero_grad_buffer()`` starts every training step; ``chunk.finish_grad_sync()`` is the first
  thing ``finalize_model_grads`` does once the last micro-batch's backward is done. Both are wrapped
  on the instance (no source changed): the first settles what an evaluation left lent, the second
  settles the step's gradients before anything reads them.
- Layer-major backward (``layer_major=True``): full recompute calls ``tensor_parallel.checkpoint(function,
  distribute_saved_activations, hidden_states, ...)`` through the module attribute, once per layer; it is
  replaced for as long as the handle is attached (the one module-level name weight streaming sets), and
  the deferred backwards run first thing in ``finish_grad_sync``, from roots whose data was given back,
  with megatron-core's own ``custom_backward``. Whether another micro-batch's forward follows: Megatron's
  micro-batch calculator (``get_num_microbatches``), else DDP's ``is_last_microbatch`` (which only a
  ``no_sync`` context clears, and Megatron-LM installs one only with --overlap-grad-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_offload.config.weight_flags import TIED_REFUSAL
from megatron_offload.core.patches import InstancePatches
from megatron_offload.core.streams import streams_for
from megatron_offload.megatron.optimizer_internals import _in_last_microbatch
from megatron_offload.weights.layer_major import LayerMajorBackward
from megatron_offload.weights.plan import Placed, Run, Unit, runs_of
from megatron_offload.weights.stats import WeightStats
from megatron_offload.weights.streamer import WeightStreamer

__all__ = ["WeightHandle", "attach_weight_streamer", "move_buffers_to_gpu"]

# Gaps between params up to this many elements are copied rather than split into another copy.
PADDING = 4096


def _transformer_layer_type() -> type:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return TransformerLayer


def _embedding_type() -> type:
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    return LanguageModelEmbedding


def _index(chunk: Any) -> dict[torch.nn.Parameter, tuple[Any, int, int]]:
    if getattr(chunk, "expert_parallel_buffers", None):
        raise ValueError("--offload-weights does not stream MoE expert weights yet: drop --num-experts")
    where = {}
    for buffer in chunk.buffers:
        for param, (start, end, _bucket) in buffer.param_index_map.items():
            where[param] = (buffer, start, end)
    return where


def _unit(name: str, index: int, params: list, where: dict, resident: bool = False) -> Unit:
    """A unit over ``params``: copy ranges per buffer, each param's offset in the unit's GPU copy."""
    runs, placed, cursor = [], [], 0
    buffers = {id(where[p][0]): where[p][0] for p in params}
    for buffer in buffers.values():
        mine = [p for p in params if where[p][0] is buffer]
        for lo, hi in runs_of([where[p][1:] for p in mine], PADDING):
            grads = buffer.grad_data[lo:hi] if buffer.grad_data is not None else None
            runs.append(Run(buffer.param_data[lo:hi], grads, cursor))
            for p in mine:
                if lo <= where[p][1] < hi:
                    placed.append(Placed(p, cursor + where[p][1] - lo, p.data, getattr(p, "main_grad", None)))
            cursor += hi - lo
    dtypes = {run.host_weights.dtype for run in runs}
    if len(dtypes) > 1:
        raise ValueError(f"--offload-weights: {name} mixes parameter dtypes {sorted(map(str, dtypes))}; use --bf16")
    return Unit(
        name,
        index,
        placed,
        runs,
        resident=resident,
        weights_dtype=runs[0].host_weights.dtype,
        grads_dtype=runs[0].host_grads.dtype if runs[0].host_grads is not None else torch.float32,
    )


@dataclass
class WeightHandle:
    """What attach_weight_streamer did, so that it can be read and undone."""

    streamer: WeightStreamer
    model: list[Any] = field(default_factory=list)  # the model chunks streamed
    patches: InstancePatches = field(default_factory=InstancePatches)
    layer_major: LayerMajorBackward | None = None

    def read_stats(self) -> WeightStats:
        return self.streamer.stats.snapshot()

    def detach(self) -> None:
        """Settle, remove every hook and wrapper: params point at megatron-core's buffers as before."""
        if self.layer_major is not None:
            self.layer_major.run()  # a backward left pending runs now: no gradient is dropped
            _unwrap_checkpoint(self.layer_major)
        self.streamer.settle()
        self.patches.undo()

    def finish_backward(self) -> None:
        """The loop's backwards are done: the deferred layer-major ones run, then the gradients settle."""
        if self.layer_major is not None:
            self.layer_major.run()
        self.streamer.settle()

    def new_step(self) -> None:
        """A training step begins (``zero_grad_buffer``): nothing lent or deferred from before."""
        if self.layer_major is not None:
            self.layer_major.clear()  # a forward that no backward followed (evaluation under grad)
        self.streamer.new_step()


def tied_embeddings(model_chunks: list[Any]) -> bool:
    """Whether the input embedding and the output layer share their weight."""
    return any(getattr(m, "share_embeddings_and_output_weights", False) for c in model_chunks for m in c.modules())


def _another_forward_follows(streamer: WeightStreamer, model_chunks: list[Any]) -> Callable[[], bool]:
    """Whether another micro-batch's forward follows the one running (before the layer-major backward):
    fewer forwards begun this step than Megatron's micro-batches per step; without Megatron's micro-batch
    calculator (megatron-core used alone), DDP's ``is_last_microbatch``, which ``no_sync`` clears."""

    def follows() -> bool:
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            return streamer.forwards < get_num_microbatches()
        except (ImportError, AttributeError, AssertionError):
            return not _in_last_microbatch(model_chunks)

    return follows


def _wrap_checkpoint(layer_major: LayerMajorBackward) -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.checkpoint = layer_major.wrap(tensor_parallel.checkpoint, input_at=1)


def _unwrap_checkpoint(layer_major: LayerMajorBackward) -> None:
    """Put the wrapped function back if ours is still the module's; else (another handle wrapped ours
    since) leave the chain and only stop cutting."""
    from megatron.core import tensor_parallel

    layer_major.enabled = False
    current = tensor_parallel.checkpoint
    if getattr(current, "cut_by", None) is layer_major:
        tensor_parallel.checkpoint = current.wrapped


def attach_weight_streamer(
    model_chunks: list[Any], weight_slots: int = 3, grad_slots: int = 3, layer_major: bool = False
) -> WeightHandle:
    """Stream the transformer layers of megatron-core DDP ``model_chunks`` (one chunk: no pipeline
    parallelism) through GPU slots; everything else stays lent to the GPU through each step.
    ``layer_major``: each layer's backwards for all micro-batches run in a row (layer_major.py); needs
    untied input and output embeddings."""
    if len(model_chunks) != 1:
        raise ValueError("--offload-weights streams one model chunk (no virtual pipeline stages)")
    if layer_major and tied_embeddings(model_chunks):
        raise ValueError(TIED_REFUSAL)
    chunk = model_chunks[0]
    where = _index(chunk)
    layer_type = _transformer_layer_type()
    layers = sorted((m for m in chunk.modules() if isinstance(m, layer_type)), key=lambda m: m.layer_number)
    if not layers:
        raise ValueError("--offload-weights found no TransformerLayer to stream in this model")
    streamed: set[torch.nn.Parameter] = set()
    units = []
    for index, layer in enumerate(layers):
        params = [p for p in layer.parameters() if p in where]
        streamed.update(params)
        units.append(_unit(f"layer {layer.layer_number}", index, params, where))
    rest = [p for p in where if p not in streamed]
    rest_ids = {id(p) for p in rest}
    resident = _unit("embedding and output", -1, rest, where, resident=True) if rest else None
    device = next(iter(where)).device
    streamer = WeightStreamer(units, resident, streams_for(device), weight_slots=weight_slots, grad_slots=grad_slots)
    handle = WeightHandle(streamer, list(model_chunks))

    for index, layer in enumerate(layers):

        def before(module: Any, args: tuple, kwargs: dict, index: int = index) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            streamer.before_forward(
                index, torch.is_grad_enabled(), hidden if isinstance(hidden, torch.Tensor) else None
            )

        def after(module: Any, args: tuple, output: Any, index: int = index) -> None:
            streamer.after_forward(index, torch.is_grad_enabled())

        handle.patches.hook(layer.register_forward_pre_hook(before, with_kwargs=True))
        handle.patches.hook(layer.register_forward_hook(after))
    owners = [m for m in chunk.modules() if any(id(p) in rest_ids for p in m.parameters(recurse=False))]
    owners += [m for m in chunk.modules() if isinstance(m, _embedding_type())]
    for module in owners:
        handle.patches.hook(module.register_forward_pre_hook(lambda *_: streamer.lend_resident()))
    if layer_major:
        from megatron.core.pipeline_parallel.schedules import custom_backward

        handle.layer_major = LayerMajorBackward(streamer, custom_backward)
        streamer.forward_again = _another_forward_follows(streamer, model_chunks)
        _wrap_checkpoint(handle.layer_major)
    handle.patches.call_before(chunk, "zero_grad_buffer", handle.new_step)  # a new step: nothing lent from before
    handle.patches.call_before(chunk, "finish_grad_sync", handle.finish_backward)  # gradients whole on host
    return handle


def move_buffers_to_gpu(modules: list[torch.nn.Module]) -> int:
    """Copy every module buffer (not parameter) into GPU memory: built inside the host pool, buffers such
    as rotary frequencies would be read over the link by every forward. Returns the bytes moved."""
    moved = 0
    for module in _all(modules):
        for name, buffer in list(module._buffers.items()):
            if isinstance(buffer, torch.Tensor) and buffer.is_cuda:
                module._buffers[name] = buffer.clone()
                moved += buffer.numel() * buffer.element_size()
    return moved


def _all(modules: list[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    for module in modules:
        yield from module.modules()
