"""CPU training for megatron-core models: hand-rolled pipeline passes and an fp32-master step.

Megatron's pipeline schedules and optimizers need CUDA.  This module (CPU with gloo; on a GPU host
the same code on the model's device, buffers allocated there) passes
activations between pipeline stages with ``send``/``recv`` by hand (no virtual pipeline) and
steps fp32 master copies with ``torch.optim.AdamW``, copying the result back into the bf16
params: the same bits contract as Megatron's mixed-precision optimizer (bf16 param =
round-to-nearest of the fp32 master).
"""

from __future__ import annotations

import copy
import zlib

import torch
import torch.distributed as dist

from nemo_dcr.integrations.megatron.params import LocalParam
from .bf16_products import bf16_products_in_fp32


def _stage_io():
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
            ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank())


def _run_stage(model, tokens: torch.Tensor, labels, hidden: int, dtype: torch.dtype):
    """Receive the input activations (unless first stage) and run this stage's forward."""
    first, _, prev, _ = _stage_io()
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    labels = None if labels is None else labels.to(device)
    inp = None
    if not first:
        inp = torch.empty(tokens.shape[1], tokens.shape[0], hidden, dtype=dtype, device=device)
        dist.recv(inp, src=prev)
        inp.requires_grad_(True)
        model.set_input_tensor(inp)
    pos = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    with bf16_products_in_fp32(device):
        out = model(tokens, pos, mask, labels=labels)  # explicit mask: the default one is CUDA
    return inp, out


def pipeline_logits(model, tokens: torch.Tensor, hidden: int, dtype: torch.dtype, vocab: int):
    """Forward through all pipeline stages; full-vocabulary logits on the last stage.

    Args:
        model: this rank's single model chunk.
        tokens: ``[batch, seq]`` int64 token ids, identical on every rank.
        hidden: hidden size (shape of the activations passed between stages).
        dtype: activation dtype.
        vocab: true vocabulary (padding columns are dropped).

    Returns:
        ``[batch, seq, vocab]`` logits on the last stage, None elsewhere.
    """
    from megatron.core import parallel_state as ps

    _, last, _, nxt = _stage_io()
    with torch.no_grad():
        _, out = _run_stage(model, tokens, None, hidden, dtype)
    if not last:
        dist.send(out.contiguous(), dst=nxt)
        return None
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab]


def pipeline_forward_backward(model, tokens: torch.Tensor, labels: torch.Tensor, hidden: int,
                              dtype: torch.dtype, reduce=lambda out: out.float().mean()) -> float | None:
    """One forward and backward through the pipeline; gradients land in ``param.grad``.

    Args:
        model: this rank's single model chunk.
        tokens: ``[B, L]`` input ids (identical on every rank).
        labels: ``[B, L]`` labels; the last stage's output is their per-token loss.
        hidden: hidden size.
        dtype: activation dtype.
        reduce: per-token loss ``[B, L]`` -> scalar loss, on the last stage (default: mean).

    Returns:
        The loss on the last stage, None elsewhere.
    """
    first, last, prev, nxt = _stage_io()
    inp, out = _run_stage(model, tokens, labels, hidden, dtype)
    loss = None
    if last:
        loss_t = reduce(out)
        with bf16_products_in_fp32(out.device):
            loss_t.backward()
        loss = float(loss_t)
    else:
        dist.send(out.detach().contiguous(), dst=nxt)
        grad = torch.empty_like(out)
        dist.recv(grad, src=nxt)
        with bf16_products_in_fp32(out.device):
            out.backward(grad)
    if not first:
        dist.send(inp.grad.contiguous(), dst=prev)
    return loss


_EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")


class MasterAdamW:
    """fp32 master copies stepped by ``torch.optim.AdamW``, copied back into bf16 params.

    Gradients are averaged over the data-parallel group (expert-DP for routed experts) and
    summed over the embedding group for tied embeddings with pipeline parallelism, like
    Megatron's DDP + ``finalize_model_grads``.
    """

    def __init__(self, params: list[LocalParam], tied: bool, lr: float = 1e-4, **adamw_kwargs):
        self.params = params
        self.tied = tied
        self.masters = [lp.param.detach().float().clone().requires_grad_(True) for lp in params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, **adamw_kwargs)

    @torch.no_grad()
    def step(self) -> None:
        """Reduce grads, step the masters, copy them back (round to the param dtype)."""
        for lp, m in zip(self.params, self.masters):
            g = lp.param.grad
            m.grad = torch.zeros_like(m) if g is None else g.float()
            lp.param.grad = None
        self._reduce_grads()
        self.opt.step()
        self.copy_back()

    @torch.no_grad()
    def adam_like_update(self, step: int, lr: float = 1e-3) -> None:
        """Drive the masters without a forward pass (where CPU cannot train the model).

        Update ``-lr * sign(noise)`` with noise from a generator seeded by (global name,
        step), so every replica of a param applies the same update: the magnitude of a real
        Adam step, changing a small fraction of the bf16 elements.
        """
        for lp, m in zip(self.params, self.masters):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{lp.global_name}@{step}".encode()))
            noise = torch.randn(m.shape, generator=gen).to(m.device)  # the same bits on any device
            m.add_(torch.sign(noise), alpha=-lr)
        self.copy_back()

    def state(self) -> dict:
        """What resuming needs: the fp32 masters and the AdamW state (copies)."""
        return dict(masters=[m.detach().clone() for m in self.masters], opt=copy.deepcopy(self.opt.state_dict()))

    @torch.no_grad()
    def load(self, state: dict) -> None:
        """Resume from :meth:`state`: masters, AdamW moments, and the bf16 params rounded from them."""
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)
        self.opt.load_state_dict(copy.deepcopy(state["opt"]))
        self.copy_back()

    @torch.no_grad()
    def copy_back(self) -> None:
        """Write ``round(master)`` into each live param."""
        for lp, m in zip(self.params, self.masters):
            lp.param.copy_(m.to(lp.param.dtype))

    def _reduce_grads(self) -> None:
        from megatron.core import parallel_state as ps

        for lp, m in zip(self.params, self.masters):
            if self.tied and lp.global_name in _EMBEDDINGS \
                    and ps.get_pipeline_model_parallel_world_size() > 1 \
                    and ps.is_rank_in_embedding_group():
                dist.all_reduce(m.grad, group=ps.get_embedding_group())
            group = (ps.get_expert_data_parallel_group() if lp.expert
                     else ps.get_data_parallel_group())
            if dist.get_world_size(group) > 1:
                dist.all_reduce(m.grad, group=group)
                m.grad.div_(dist.get_world_size(group))
