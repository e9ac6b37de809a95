"""A small GPT: a plain ``torch.nn.Module`` that funcamp turns into a pure function.

Pre-norm decoder blocks (LayerNorm, causal self-attention with ``scaled_dot_product_attention``, MLP
with GELU), learned position embeddings, and an output layer tied to the token embedding. No buffers
and no dropout by default, so ``funcamp.nn.functionalize`` returns ``(apply_fn, params)``.

Importable (``from gpt import GPT, GPTConfig``) by ``train_gpt.py``, ``amp_basics.py`` and the
benchmark. Named sizes: :data:`SIZES` (``"tiny"`` for tests, ``"small"`` the CPU default, ``"gpt2-124m"``
the shape of OpenAI's GPT-2 small, 124,439,808 parameters).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "SIZES", "config_for"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    Attributes:
      vocab_size: tokens in the vocabulary (256 for bytes).
      block_size: the longest context, in tokens (size of the position embedding).
      n_layer: decoder blocks.
      n_head: attention heads; must divide ``n_embd``.
      n_embd: width of the residual stream.
      bias: biases in the linear layers and LayerNorms (GPT-2 has them).
      dropout: dropout probability on attention and residual outputs (0: none, deterministic).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be an int >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must divide n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")


#: Named model sizes (byte vocabulary except GPT-2's).
SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2-124m": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=True),
}


def config_for(size: str, **overrides: object) -> GPTConfig:
    """The config of a named size, with some fields replaced (e.g. ``block_size``).

    Raises:
      ValueError: if ``size`` is not a key of :data:`SIZES`.
    """
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    return dataclasses.replace(SIZES[size], **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), p, self.training)


_GELU_K, _GELU_C = 1.5957691216057308, 0.044715  # 2 * sqrt(2 / pi), and the cubic term's coefficient


class GeluTanh(torch.autograd.Function):
    """GPT-2's GELU, ``F.gelu(x, approximate="tanh")``, written as ``x * sigmoid(2z)`` (``0.5 * (1 + tanh(z))`` is
    ``sigmoid(2z)``) in float32 and cast back: the same function to float32 round-off (4.8e-7 at most on N(0, 1)
    inputs), but on a CPU inductor's vectorized ``tanh`` costs 2.6x the sigmoid's ``exp`` (compiled, forward and
    backward over 4096 x 512 float32: 9.8 ms in the tanh form, 3.7 ms in this one; quiet Xeon, 2 threads). A
    Function that saves only its input, as ``F.gelu`` does: written with plain ops, autograd would keep the
    float32 intermediates for the backward (GPT small in bfloat16, the compiled donating step: 106 MB over the
    state at rest against 74 MB)."""

    @staticmethod
    def _gate(h: torch.Tensor) -> torch.Tensor:
        """``sigmoid(2z)``, ``z = sqrt(2 / pi) * (h + 0.044715 * h**3)``, of float32 ``h``."""
        return torch.sigmoid(_GELU_K * (h + _GELU_C * h * h * h))

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * GeluTanh._gate(h)).to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        h = x.float()
        s = GeluTanh._gate(h)
        slope = s + h * s * (1.0 - s) * (_GELU_K * (1.0 + 3.0 * _GELU_C * h * h))
        return (grad.float() * slope).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(GeluTanh.apply(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2 layout, pre-norm, tied embeddings).

    ``forward(idx)``: ``idx`` is ``(batch, time)`` int64 token ids with ``time <= block_size``;
    returns ``(batch, time, vocab_size)`` logits in the dtype the layers compute in.

    Initialisation as GPT-2: normal(0, 0.02) weights, residual projections scaled by
    ``1 / sqrt(2 * n_layer)``, zero biases. The output layer shares the token embedding's tensor
    (``lm_head.weight is wte.weight``), so ``named_parameters()`` lists it once, as ``wte.weight``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.drop = cfg.dropout
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(idx))

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """``(batch, time, n_embd)``: what the output layer (``lm_head``, weight ``wte.weight``) is applied to.

        For a loss that takes the hidden states and the head's weight, such as
        ``funcamp.nn.linear_cross_entropy(model.hidden_states(idx), model.lm_head.weight, targets)``.
        """
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = F.dropout(self.wte(idx) + self.wpe(pos), self.drop, self.training)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def num_params(self) -> int:
        """Number of parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())
