"""Small test and demo models built from configs with random weights (nothing is downloaded).

Every factory takes size keywords with tiny defaults and returns ``(model, (args, kwargs))``:
``args`` is the tuple of positional example inputs, ``kwargs`` a dict of keyword inputs. Models
that compute their own loss get their labels in ``kwargs`` so that ``model(*args, **kwargs)``
returns the loss (HF models: ``labels=``; :class:`MoEModel`: ``target=``)::

    model, (args, kwargs) = zoo.gpt2(layers=2)
    captured = capture(model, args, kwargs=kwargs)

``device="meta"`` builds the model and its inputs on the meta device (no memory, no data), which
is how configs too large for this machine are planned: ``zoo.llama(config=llama2_70b_config(),
device="meta")``. Weights are initialised under a fixed ``seed`` without touching the caller's
global RNG state. HF models are built with ``use_cache=False`` and ``attn_implementation="sdpa"``
and returned in training mode (dropout probabilities default to 0 so runs are reproducible).
transformers is imported inside the factories only.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from autopar.core.errors import ZooError

if TYPE_CHECKING:
    from transformers import LlamaConfig

Example = tuple[tuple, dict]


@contextlib.contextmanager
def _building(device, seed: int):
    """Seeded RNG (the caller's state is restored afterwards) and the target default device."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            yield


def _finish(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    return model.to(dtype).train()


_HF_COMMON = dict(use_cache=False, attn_implementation="sdpa")


# ----------------------------------------------------------------------------- HF language models


def gpt2(*, layers: int = 2, hidden: int = 32, heads: int = 4, vocab: int = 128, seq: int = 8,
         batch: int = 2, dropout: float = 0.0, dtype: torch.dtype = torch.float32,
         device=None, seed: int = 0) -> tuple[nn.Module, Example]:
    """GPT2LMHeadModel (``lm_head.weight`` tied to ``transformer.wte.weight``); returns the loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                     n_positions=max(seq, 8), resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                     **_HF_COMMON)
    with _building(device, seed):
        model = _finish(GPT2LMHeadModel(cfg), dtype)
        ids = torch.randint(0, vocab, (batch, seq))
    # the loss GPT2LMHeadModel computes anyway, named: transformers cannot infer it from the class
    # name and otherwise warns on every first forward of a process
    model.loss_type = "ForCausalLM"
    return model, ((ids,), {"labels": ids.clone()})  # a copy: export merges one tensor passed twice


GPT2_SMALL = dict(layers=12, hidden=768, heads=12, vocab=50304)  # 124M parameters


def gpt2_small(*, seq: int = 1024, batch: int = 8, dtype: torch.dtype = torch.float32, device="meta",
               seed: int = 0) -> tuple[nn.Module, Example]:
    """GPT-2 small's shape (:data:`GPT2_SMALL`: 12 layers, hidden 768, 12 heads, vocabulary 50,257
    padded to 50,304) with ``batch`` sequences of ``seq`` tokens, on the meta device unless
    ``device`` says otherwise: a realistic model to plan (``autopar plan autopar.zoo:gpt2_small``)."""
    return gpt2(**GPT2_SMALL, seq=seq, batch=batch, dtype=dtype, device=device, seed=seed)


def _llama2_config(*, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2,
                       **_HF_COMMON)


def llama2_7b_config() -> LlamaConfig:
    """LlamaConfig of LLaMA-2-7B: 32 layers, hidden 4096, 32 heads (no grouping), FFN 11008."""
    return _llama2_config(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008)


def llama2_70b_config() -> LlamaConfig:
    """LlamaConfig of LLaMA-2-70B: 80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672."""
    return _llama2_config(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672)


def llama(*, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 64,
          vocab: int = 128, seq: int = 8, batch: int = 2, config=None,
          dtype: torch.dtype = torch.float32, device=None, seed: int = 0
          ) -> tuple[nn.Module, Example]:
    """LlamaForCausalLM with grouped-query attention (``kv_heads < heads``); returns the loss.

    ``config`` (a LlamaConfig) replaces the size keywords; ``seq``/``batch`` still apply.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if config is None:
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn,
                             num_attention_heads=heads, num_key_value_heads=kv_heads,
                             vocab_size=vocab, max_position_embeddings=max(seq, 8),
                             bos_token_id=0, eos_token_id=vocab - 1,
                             **_HF_COMMON)
    else:
        config.use_cache = False
        config._attn_implementation = "sdpa"
    with _building(device, seed):
        model = _finish(LlamaForCausalLM(config), dtype)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, ((ids,), {"labels": ids.clone()})


def bert(*, layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, vocab: int = 128,
         seq: int = 8, batch: int = 2, dropout: float = 0.0, dtype: torch.dtype = torch.float32,
         device=None, seed: int = 0) -> tuple[nn.Module, Example]:
    """BertForMaskedLM (decoder weight tied to the word embeddings); returns the MLM loss."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=max(seq, 8),
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     pad_token_id=0, **_HF_COMMON)
    with _building(device, seed):
        model = _finish(BertForMaskedLM(cfg), dtype)
        ids = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
    return model, ((ids,), {"labels": labels})


def _from_config(config, *, seq: int, batch: int, dtype: torch.dtype, device, seed: int
                 ) -> tuple[nn.Module, Example]:
    """An HF causal or (``config.is_encoder_decoder``) seq2seq LM from ``config``, with
    ``input_ids`` and ``labels`` of ``(batch, seq)`` random tokens; returns the loss."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    with _building(device, seed):
        model = _finish(auto.from_config(config), dtype)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, ((ids,), {"labels": ids.clone()})


def phi3_mini(*, seq: int = 1024, batch: int = 8, dtype: torch.dtype = torch.float32, device="meta",
              seed: int = 0) -> tuple[nn.Module, Example]:
    """Phi-3-mini's shape (3.8B: 32 layers, hidden 3072, 32 heads, FFN 8192, vocabulary 32,064),
    on the meta device unless ``device`` says otherwise; returns the loss."""
    from transformers import Phi3Config

    config = Phi3Config(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                        max_position_embeddings=4096, pad_token_id=32000, **_HF_COMMON)
    return _from_config(config, seq=seq, batch=batch, dtype=dtype, device=device, seed=seed)


def mistral_7b(*, seq: int = 1024, batch: int = 8, dtype: torch.dtype = torch.float32, device="meta",
               seed: int = 0) -> tuple[nn.Module, Example]:
    """Mistral-7B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336), full
    attention (no sliding window), on the meta device unless ``device`` says otherwise."""
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                           max_position_embeddings=4096, sliding_window=None, **_HF_COMMON)
    return _from_config(config, seq=seq, batch=batch, dtype=dtype, device=device, seed=seed)


def bart_large(*, seq: int = 1024, batch: int = 8, dtype: torch.dtype = torch.float32, device="meta",
               seed: int = 0) -> tuple[nn.Module, Example]:
    """BART-large's shape (encoder-decoder, 12 + 12 layers, hidden 1024, 16 heads, FFN 4096), on
    the meta device unless ``device`` says otherwise; the labels are the input tokens."""
    from transformers import BartConfig

    config = BartConfig(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                        vocab_size=50265, max_position_embeddings=max(seq, 1024), **_HF_COMMON)
    return _from_config(config, seq=seq, batch=batch, dtype=dtype, device=device, seed=seed)


# ----------------------------------------------------------------------------- HF vision models


def vit(*, layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, image: int = 16,
        patch: int = 4, classes: int = 10, batch: int = 2, dropout: float = 0.0,
        dtype: torch.dtype = torch.float32, device=None, seed: int = 0
        ) -> tuple[nn.Module, Example]:
    """ViTForImageClassification on ``image``² RGB images; returns the classification loss."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                    intermediate_size=ffn, image_size=image, patch_size=patch, num_labels=classes,
                    hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                    **_HF_COMMON)
    with _building(device, seed):
        model = _finish(ViTForImageClassification(cfg), dtype)
        pixels = torch.randn(batch, 3, image, image, dtype=dtype)
        labels = torch.randint(0, classes, (batch,))
    return model, ((pixels,), {"labels": labels})


def resnet(*, widths: tuple[int, ...] = (16, 32), depths: tuple[int, ...] = (2, 2),
           layer_type: str = "basic", image: int = 32, classes: int = 10, batch: int = 2,
           dtype: torch.dtype = torch.float32, device=None, seed: int = 0
           ) -> tuple[nn.Module, Example]:
    """ResNetForImageClassification (BatchNorm, so training updates running stats); returns the loss.

    The stem width equals ``widths[0]``, so the first stage's blocks are all alike while each later
    stage starts with a projection-shortcut block.
    """
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=widths[0], hidden_sizes=list(widths),
                       depths=list(depths), layer_type=layer_type, num_labels=classes)
    with _building(device, seed):
        model = _finish(ResNetForImageClassification(cfg), dtype)
        pixels = torch.randn(batch, 3, image, image, dtype=dtype)
        labels = torch.randint(0, classes, (batch,))
    return model, ((pixels,), {"labels": labels})


# ----------------------------------------------------------------------------- our own models


class MLP(nn.Module):
    """Two linear layers with a ReLU between them."""

    def __init__(self, inp: int, hidden: int, out: int):
        super().__init__()
        self.fc1 = nn.Linear(inp, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def mlp(*, inp: int = 16, hidden: int = 32, out: int = 8, batch: int = 4,
        dtype: torch.dtype = torch.float32, device=None, seed: int = 0
        ) -> tuple[nn.Module, Example]:
    """A plain 2-layer :class:`MLP`; it returns its output (no loss: pass a ``loss_fn``)."""
    with _building(device, seed):
        model = _finish(MLP(inp, hidden, out), dtype)
        x = torch.randn(batch, inp, dtype=dtype)
    return model, ((x,), {})


class MoELayer(nn.Module):
    """GShard-style mixture of experts with dense einsum dispatch (no data-dependent control flow).

    Tokens are grouped by batch row (G groups of S tokens, model width M). The gate picks the
    top-``k`` of E experts per token; each expert takes at most C = ceil(k·S·capacity_factor / E)
    tokens per group, in token order, and tokens over capacity are dropped for that expert.
    ``dispatch[g,s,e,c]`` is 1 where token s goes to slot c of expert e; ``combine`` is the same
    tensor weighted by the (renormalised, for k > 1) gate value. Then::

        expert_in  = einsum("gsec,gsm->egcm", dispatch, x)
        expert_out = einsum("egch,ehm->egcm", act(einsum("egcm,emh->egch", expert_in, w_in)), w_out)
        y          = einsum("gsec,egcm->gsm", combine, expert_out)

    ``forward`` returns ``(y, aux)`` where ``aux`` is the load-balancing loss
    E·Σ_e mean_s(gate prob)·mean_s(first choice == e), averaged over groups.
    """

    def __init__(self, d_model: int, ffn: int, experts: int, *, top_k: int = 2,
                 capacity_factor: float = 1.25):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ZooError(f"MoE top_k must be between 1 and experts={experts}, got {top_k}")
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.w_gate = nn.Parameter(torch.empty(d_model, experts))
        self.w_in = nn.Parameter(torch.empty(experts, d_model, ffn))
        self.w_out = nn.Parameter(torch.empty(experts, ffn, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w, fan_in in ((self.w_gate, self.w_gate.shape[0]), (self.w_in, self.w_in.shape[1]),
                          (self.w_out, self.w_out.shape[1])):
            nn.init.normal_(w, std=fan_in ** -0.5)

    def capacity(self, tokens_per_group: int) -> int:
        experts = self.w_gate.shape[1]
        return max(1, math.ceil(self.top_k * tokens_per_group * self.capacity_factor / experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups, tokens, _ = x.shape
        experts = self.w_gate.shape[1]
        cap = self.capacity(tokens)
        probs = torch.softmax(torch.einsum("gsm,me->gse", x, self.w_gate), dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)  # [G, S, k]
        if self.top_k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        expert_ids = torch.arange(experts, device=x.device)
        slot_ids = torch.arange(cap, device=x.device, dtype=x.dtype)
        filled = torch.zeros(groups, 1, experts, device=x.device, dtype=x.dtype)
        dispatch = torch.zeros(groups, tokens, experts, cap, device=x.device, dtype=x.dtype)
        combine = torch.zeros_like(dispatch)
        first_choice = None
        for j in range(self.top_k):  # a static loop over k, not over data
            mask = (choice[..., j : j + 1] == expert_ids).to(x.dtype)  # [G, S, E]
            if first_choice is None:
                first_choice = mask
            slot = torch.cumsum(mask, dim=1) - 1 + filled  # [G, S, E]
            filled = filled + mask.sum(dim=1, keepdim=True)
            kept = mask * (slot < cap).to(x.dtype)
            onehot = (slot.unsqueeze(-1) == slot_ids).to(x.dtype)  # [G, S, E, C]
            routed = kept.unsqueeze(-1) * onehot
            dispatch = dispatch + routed
            combine = combine + gate[..., j, None, None] * routed
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, x)
        hidden = F.gelu(torch.einsum("egcm,emh->egch", expert_in, self.w_in))
        expert_out = torch.einsum("egch,ehm->egcm", hidden, self.w_out)
        y = torch.einsum("gsec,egcm->gsm", combine, expert_out)
        aux = experts * (probs.mean(dim=1) * first_choice.mean(dim=1)).sum(dim=-1).mean()
        return y, aux


class MoEBlock(nn.Module):
    """Pre-norm residual block around a :class:`MoELayer`."""

    def __init__(self, d_model: int, ffn: int, experts: int, *, top_k: int,
                 capacity_factor: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.moe = MoELayer(d_model, ffn, experts, top_k=top_k, capacity_factor=capacity_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux = self.moe(self.norm(x))
        return x + y, aux


class MoEModel(nn.Module):
    """A stack of :class:`MoEBlock` then a linear head; with ``target`` it returns
    MSE(output, target) + ``aux_weight`` · Σ load-balancing losses, else the output."""

    def __init__(self, d_model: int, ffn: int, experts: int, layers: int, *, top_k: int = 2,
                 capacity_factor: float = 1.25, aux_weight: float = 0.01):
        super().__init__()
        self.aux_weight = aux_weight
        self.blocks = nn.ModuleList(
            MoEBlock(d_model, ffn, experts, top_k=top_k, capacity_factor=capacity_factor)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        aux_total = x.new_zeros(())
        for block in self.blocks:
            x, aux = block(x)
            aux_total = aux_total + aux
        out = self.head(x)
        if target is None:
            return out
        return F.mse_loss(out, target) + self.aux_weight * aux_total


def moe(*, d_model: int = 16, ffn: int = 32, experts: int = 4, top_k: int = 2, layers: int = 2,
        capacity_factor: float = 1.25, seq: int = 8, batch: int = 2,
        dtype: torch.dtype = torch.float32, device=None, seed: int = 0
        ) -> tuple[nn.Module, Example]:
    """A :class:`MoEModel` on ``[batch, seq, d_model]`` inputs; returns the loss (``target=``)."""
    with _building(device, seed):
        model = _finish(MoEModel(d_model, ffn, experts, layers, top_k=top_k,
                                 capacity_factor=capacity_factor), dtype)
        x = torch.randn(batch, seq, d_model, dtype=dtype)
        target = torch.randn(batch, seq, d_model, dtype=dtype)
    return model, ((x,), {"target": target})


__all__ = [
    "MLP",
    "MoEBlock",
    "MoELayer",
    "MoEModel",
    "bart_large",
    "bert",
    "gpt2",
    "gpt2_small",
    "llama",
    "llama2_70b_config",
    "llama2_7b_config",
    "mistral_7b",
    "mlp",
    "moe",
    "phi3_mini",
    "resnet",
    "vit",
]
