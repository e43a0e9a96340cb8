"""A CPU **stand-in** for vLLM's weight-loading contract (not vLLM, imports nothing of it).

It mimics what :mod:`nemo_dcr.apply.placement` relies on, so the probing logic is tested on CPU:

* params carry a ``weight_loader(param, loaded_weight, *shard)`` attribute that writes into
  ``param.data`` (vLLM's v0 loader contract);
* ``StandinQKV``: column-parallel ``qkv_proj`` with shard ids ``"q"``/``"k"``/``"v"`` (KV heads
  replicated when TP exceeds their count, as in ``QKVParallelLinear``);
* ``StandinMergedColumn``: ``gate_up_proj`` with shard ids ``0``/``1``;
* ``StandinRow``: row-parallel (input dim sharded);
* ``StandinVocab``: vocab-parallel embedding padded to a multiple of ``pad_to``, padding rows
  zero-filled by the loader (as ``VocabParallelEmbedding`` does);
* ``StandinMoE``: fused experts ``w13_weight`` [E_local, 2*I/tp, H] and ``w2_weight``
  [E_local, H, I/tp], loader ``(param, w, weight_name, shard_id=, expert_id=, return_success=)``
  with shard ids ``w1``/``w3``/``w2`` and EP by contiguous expert ranges;
* ``StandinModel.load_weights`` routes HF names with a ``stacked_params_mapping`` and an expert
  mapping like vLLM's model files, skips ``rotary_emb.inv_freq`` as vLLM's Llama does, and returns
  the names it loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StandinDims:
    """Sizes of the stand-in model (by default one dense layer, then one MoE layer).

    ``layers`` layers; with ``experts`` every odd layer is MoE.  ``post_norm`` adds each layer's
    ``post_attention_layernorm`` and ``lm_head`` an untied vocab-parallel output layer (both as
    in vLLM's Llama), so :meth:`of` can describe a dense megatron-core model.
    """

    hidden: int = 8
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 2
    ffn: int = 12
    vocab: int = 10
    pad_to: int = 8
    experts: int = 4
    moe_ffn: int = 8
    layers: int = 2
    post_norm: bool = False
    lm_head: bool = False

    @classmethod
    def of(cls, dims, pad_to: int = 64) -> "StandinDims":
        """The stand-in of a dense Llama-family :class:`~nemo_dcr.layout.ModelDims` (the
        description megatron-core builds the policy model from), loading its HF tensors.

        Raises:
            ValueError: a model the stand-in does not describe (MoE, MLA, q/k norms, qkv bias).
        """
        if dims.num_experts or dims.multi_latent_attention or dims.qk_layernorm or dims.add_qkv_bias:
            raise ValueError("StandinDims.of describes dense Llama-family models only")
        return cls(hidden=dims.hidden_size, heads=dims.num_attention_heads, kv_heads=dims.kv_heads,
                   head_dim=dims.kv_channels, ffn=dims.ffn_hidden_size, vocab=dims.vocab_size, pad_to=pad_to,
                   experts=0, moe_ffn=0, layers=dims.num_layers, post_norm=True,
                   lm_head=not dims.tie_word_embeddings)

    def moe(self, layer: int) -> bool:
        """Layer ``layer`` has routed experts."""
        return bool(self.experts) and layer % 2 == 1


def _param(shape, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
    p.weight_loader = loader
    return p


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Replicated tensor: copy whole (vLLM's ``default_weight_loader``)."""
    param.data.copy_(loaded)


class StandinQKV(nn.Module):
    """``qkv_proj``: rows [q_local | k_local | v_local], each a TP shard of its canonical tensor."""

    def __init__(self, d: StandinDims, tp: int, rank: int):
        super().__init__()
        self.tp, self.rank, self.hd = tp, rank, d.head_dim
        self.q_heads, self.kv_local = d.heads // tp, max(1, d.kv_heads // tp)
        self.kv_replicas = max(1, tp // d.kv_heads)
        rows = (self.q_heads + 2 * self.kv_local) * d.head_dim
        self.weight = _param((rows, d.hidden), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.q_heads * self.hd, self.kv_local * self.hd
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        shard_rank = self.rank if shard_id == "q" else self.rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard_rank * size, size))


class StandinMergedColumn(nn.Module):
    """``gate_up_proj``: rows [gate shard | up shard]."""

    def __init__(self, d: StandinDims, tp: int, rank: int):
        super().__init__()
        self.rank, self.size = rank, d.ffn // tp
        self.weight = _param((2 * self.size, d.hidden), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        part = loaded.narrow(0, self.rank * self.size, self.size)
        param.data.narrow(0, shard_id * self.size, self.size).copy_(part)


class StandinRow(nn.Module):
    """Row-parallel linear: the input (last) dim is sharded."""

    def __init__(self, out_features: int, in_features: int, tp: int, rank: int):
        super().__init__()
        self.rank, self.size = rank, in_features // tp
        self.weight = _param((out_features, self.size), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.rank * self.size, self.size))


class StandinVocab(nn.Module):
    """Vocab-parallel embedding: vocab padded to ``pad_to``, rows split over TP, padding zeroed."""

    def __init__(self, d: StandinDims, tp: int, rank: int):
        super().__init__()
        padded = -(-d.vocab // d.pad_to) * d.pad_to
        self.rows = padded // tp
        self.start, self.vocab = rank * self.rows, d.vocab
        self.weight = _param((self.rows, d.hidden), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = max(0, min(self.vocab - self.start, self.rows))
        param.data[:n].copy_(loaded[self.start:self.start + n])
        param.data[n:].fill_(0)


class StandinMoE(nn.Module):
    """Fused experts with TP inside each expert and EP over contiguous expert ranges."""

    def __init__(self, d: StandinDims, tp: int, rank: int, ep: int = 1, ep_rank: int = 0):
        super().__init__()
        self.local = d.experts // ep
        self.first, self.rank, self.size = ep_rank * self.local, rank, d.moe_ffn // tp
        self.w13_weight = _param((self.local, 2 * self.size, d.hidden), self.weight_loader)
        self.w2_weight = _param((self.local, d.hidden, self.size), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, weight_name: str, shard_id: str,
                      expert_id: int, return_success: bool = False):
        e = expert_id - self.first
        if not 0 <= e < self.local:
            return False if return_success else None
        if shard_id == "w2":
            param.data[e].copy_(loaded.narrow(1, self.rank * self.size, self.size))
        else:
            half = 0 if shard_id == "w1" else 1
            part = loaded.narrow(0, self.rank * self.size, self.size)
            param.data[e].narrow(0, half * self.size, self.size).copy_(part)
        return True if return_success else None


def canonical_shapes(d: StandinDims) -> dict[str, tuple[int, ...]]:
    """HF names and shapes the stand-in model loads."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {"model.embed_tokens.weight": (d.vocab, h), "model.norm.weight": (h,)}
    if d.lm_head:
        out["lm_head.weight"] = (d.vocab, h)
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "input_layernorm.weight": (h,)})
        if d.post_norm:
            out[p + "post_attention_layernorm.weight"] = (h,)
        if not d.moe(i):
            out.update({p + "mlp.gate_proj.weight": (d.ffn, h), p + "mlp.up_proj.weight": (d.ffn, h),
                        p + "mlp.down_proj.weight": (h, d.ffn)})
            continue
        for e in range(d.experts):
            pe = f"{p}mlp.experts.{e}."
            out.update({pe + "gate_proj.weight": (d.moe_ffn, h), pe + "up_proj.weight": (d.moe_ffn, h),
                        pe + "down_proj.weight": (h, d.moe_ffn)})
    return out


class StandinModel(nn.Module):
    """``d.layers`` layers (dense MLP, then MoE, alternating; all dense without experts) with
    vLLM-style fused params and ``load_weights``; ``lm_head`` (when ``d.lm_head``) is top-level,
    as in vLLM's ``LlamaForCausalLM``."""

    stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                              (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
                              (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, d: StandinDims = StandinDims(), tp: int = 1, rank: int = 0, ep: int = 1, ep_rank: int = 0):
        super().__init__()
        self.embed_tokens = StandinVocab(d, tp, rank)
        self.norm = nn.Module()
        self.norm.weight = _param((d.hidden,), default_weight_loader)
        if d.lm_head:
            self.lm_head = StandinVocab(d, tp, rank)
        self.layers = nn.ModuleList()
        for i in range(d.layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = StandinQKV(d, tp, rank)
            layer.self_attn.o_proj = StandinRow(d.hidden, d.heads * d.head_dim, tp, rank)
            layer.input_layernorm = nn.Module()
            layer.input_layernorm.weight = _param((d.hidden,), default_weight_loader)
            if d.post_norm:
                layer.post_attention_layernorm = nn.Module()
                layer.post_attention_layernorm.weight = _param((d.hidden,), default_weight_loader)
            layer.mlp = nn.Module()
            if not d.moe(i):
                layer.mlp.gate_up_proj = StandinMergedColumn(d, tp, rank)
                layer.mlp.down_proj = StandinRow(d.hidden, d.ffn, tp, rank)
            else:
                layer.mlp.experts = StandinMoE(d, tp, rank, ep, ep_rank)
            self.layers.append(layer)
        self.expert_params_mapping = [
            ("experts.w13_" if w in ("gate_proj", "up_proj") else "experts.w2_", f"experts.{e}.{w}.", e, s)
            for e in range(d.experts) for w, s in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))]

    def load_weights(self, weights) -> set[str]:
        """vLLM-style routing of HF names to params and loaders; returns the names loaded."""
        params = {("" if n.startswith("lm_head.") else "model.") + n: p for n, p in self.named_parameters()}
        loaded = set()
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:  # computed by the model, not loaded (vLLM skips it)
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name in name and "experts" not in name:
                    p = params[name.replace(weight_name, param_name)]
                    p.weight_loader(p, w, shard_id)
                    break
            else:
                for param_name, weight_name, expert_id, shard_id in self.expert_params_mapping:
                    if weight_name in name:
                        mapped = name.replace(weight_name, param_name)
                        p = params[mapped]
                        p.weight_loader(p, w, mapped, shard_id=shard_id, expert_id=expert_id, return_success=True)
                        break
                else:
                    if name not in params:
                        raise KeyError(f"unknown weight {name}; known: {sorted(params)[:6]}...")
                    params[name].weight_loader(params[name], w)
            loaded.add(name)
        return loaded


def reference_mismatches_of(state: dict, engines, dims: StandinDims, tp: int) -> list[str]:
    """Params of each vLLM stand-in worker (``engines``: replicas, each a list of TP workers)
    whose bits differ from a fresh :class:`StandinModel` of ``dims`` loaded, through its own
    ``load_weights``, with the dense HF ``state``: vLLM's own full load, never the refit's mapping."""
    from nemo_dcr.types import int_view

    out = []
    for d, engine in enumerate(engines):
        for w in engine:
            ref = StandinModel(dims, tp, w.rank)
            ref.load_weights(state.items())
            live = dict(w.model_runner.model.named_parameters())
            out += [f"dp{d}/tp{w.rank}:{n}" for n, p in ref.named_parameters()
                    if not torch.equal(int_view(p.data), int_view(live[n].data))]
    return out


class StandinTruthModel(StandinModel):
    """:class:`StandinModel` plus the loader patterns that defeat a naive probe (a stand-in, not vLLM):

    * ``layers.0.mixer.A`` (fp32) loaded as ``-exp(A_log)`` through a composed loader, as vLLM's
      Mamba2 mixer does (a value transform);
    * ``layers.1.mlp.router_experts.w13`` written by ``load_weights`` itself with ``param.copy_`` of
      the transposed checkpoint tensor ``[E, H, 2I]``, bypassing ``weight_loader``, as gpt-oss does;
    * ``model.mtp.0.weight`` in the checkpoint, which ``load_weights`` skips (an MTP layer);
    * ``layers.0.self_attn.W_T``, a transposed copy of ``o_proj`` made by the attention module's
      ``process_weights_after_loading`` (a derived tensor, like MLA's ``W_UV``).
    """

    def __init__(self, d: StandinDims = StandinDims(), tp: int = 1, rank: int = 0):
        super().__init__(d, tp, rank)
        self.d = d
        mixer = nn.Module()
        mixer.A = nn.Parameter(torch.zeros(d.heads, dtype=torch.float32), requires_grad=False)

        def a_loader(param, loaded):
            param.data.copy_(loaded)
            param.data.copy_(-torch.exp(param.data.float()))
        mixer.A.weight_loader = a_loader
        self.layers[0].mixer = mixer
        experts = nn.Module()
        experts.w13 = nn.Parameter(torch.zeros(d.experts, 2 * d.moe_ffn, d.hidden, dtype=torch.bfloat16),
                                   requires_grad=False)
        self.layers[1].mlp.router_experts = experts
        attn = self.layers[0].self_attn
        attn.W_T = nn.Parameter(torch.zeros(attn.o_proj.weight.shape[::-1], dtype=torch.bfloat16), requires_grad=False)
        attn.process_weights_after_loading = lambda: attn.W_T.data.copy_(attn.o_proj.weight.data.T)

    def load_weights(self, weights) -> set[str]:
        rest, loaded = [], set()
        params = {"model." + n: p for n, p in self.named_parameters()}
        for name, w in weights:
            if name.startswith("model.mtp."):
                continue
            if name.endswith("mixer.A_log"):
                p = params[name.replace("A_log", "A")]
                p.weight_loader(p, w)
            elif name.endswith("router_experts.gate_up_proj"):
                params[name.replace("gate_up_proj", "w13")].copy_(w.transpose(-1, -2))
            else:
                rest.append((name, w))
                continue
            loaded.add(name)
        return loaded | super().load_weights(rest)


def truth_shapes(d: StandinDims = StandinDims()) -> dict[str, tuple[int, ...]]:
    """HF names and shapes :class:`StandinTruthModel` is given (its skipped MTP weight included)."""
    out = dict(canonical_shapes(d))
    out.update({"model.layers.0.mixer.A_log": (d.heads,), "model.mtp.0.weight": (d.hidden, d.hidden),
                "model.layers.1.mlp.router_experts.gate_up_proj": (d.experts, d.hidden, 2 * d.moe_ffn)})
    return out
