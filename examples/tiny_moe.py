"""A tiny mixture-of-experts transformer, its reduced-precision rollout engines, and a toy counting task.

Everything the demo (``examples/demo.py``) needs besides the library, in plain PyTorch on CPU:

* :class:`TinyMoE`: a causal decoder (pre-norm attention + MoE blocks, top-K routing over E experts,
  Mixtral-style: softmax over the router logits, keep the K largest, renormalise). It returns, next to
  the logits, the routed expert ids of every position and layer, ordered by routing weight, highest first.
* :class:`RolloutEngine`: the SAME weights run in reduced precision, the way an inference engine serves
  them, generating with a KV cache:

  - ``"bf16"``: every weight cast to bfloat16, activations in bfloat16;
  - ``"fp8"``: fp8-e4m3 weight-only quantisation (``torch.float8_e4m3fn``, one scale per output channel,
    ``scale = amax / 448``) of the attention projections and the expert matrices, dequantised to
    bfloat16 for the matmuls (W8A16, as fp8 checkpoints are served on hardware without fp8 matmuls);
    the router gate, embeddings, norms and output head stay in bfloat16, as fp8 MoE recipes keep them.

  In both cases the router logits are turned into probabilities in float32, as inference kernels do, and
  the sampled token's log-probability is the float32 log-softmax of the engine's logits. So the
  log-probability mismatch and the router mismatch the demo measures are real numerics, not injected noise.
* The task (:func:`make_prompts`, :func:`rewards_for`): a prompt ``[BOS, start, stride]`` asks to count
  up from ``start`` in steps of ``stride`` (mod 10) for ``T`` tokens; the reward is the share of the
  ``T`` positions whose token is the previous one plus ``stride``. An ``EOS`` token ends a response early (the
  rest of the row is padding, outside ``response_mask``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# -- the toy task --------------------------------------------------------------------------------------
DIGITS = 10
BOS, EOS, PAD = 10, 11, 12
VOCAB = 16  # 0-9, BOS, EOS, PAD and 3 unused tokens (never right)
STRIDES = (1, 2, 3)
PROMPT_LEN = 3


def make_prompts(num: int, generator: torch.Generator) -> Tensor:
    """``[num, 3]`` prompts ``[BOS, start, stride]``."""
    start = torch.randint(0, DIGITS, (num,), generator=generator)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (num,), generator=generator)]
    return torch.stack([torch.full((num,), BOS), start, stride], dim=1)


def response_mask_for(tokens: Tensor) -> Tensor:
    """1 on policy tokens: every token up to and including the first EOS, 0 after it."""
    eos_before = torch.cumsum((tokens == EOS).long(), dim=1) - (tokens == EOS).long()
    return eos_before == 0


def rewards_for(prompts: Tensor, tokens: Tensor) -> Tensor:
    """Share of the ``T`` positions whose token is the previous one plus ``stride`` (mod 10), the first
    one counting from ``start``; positions after an EOS score 0.

    Example:
        >>> p = torch.tensor([[BOS, 8, 3], [BOS, 8, 3]])
        >>> rewards_for(p, torch.tensor([[1, 4, 7, 0], [1, EOS, 7, 0]])).tolist()  # 8 + 3 = 11 -> 1, 4, 7, 0
        [1.0, 0.25]
        >>> rewards_for(p[:1], torch.tensor([[1, 5, 8, 1]])).tolist()  # one slip: 4 -> 5, then 5 + 3 = 8, 8 + 3 = 11
        [0.75]
    """
    prev = torch.cat([prompts[:, 1:2], tokens[:, :-1]], dim=1)
    right = (tokens == (prev + prompts[:, 2:3]) % DIGITS) & (tokens < DIGITS) & response_mask_for(tokens)
    return right.float().mean(dim=1)


# -- the model -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEConfig:
    vocab: int = VOCAB
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 128
    max_len: int = 32


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cache: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Causal self-attention over ``cache + x``; returns the output and the extended cache."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        past = k.shape[2] - t
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        future = torch.ones(t, k.shape[2], dtype=torch.bool).triu(past + 1)
        scores = scores.masked_fill(future, float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(y), (k, v)


class MoE(nn.Module):
    """Top-K routed experts (SiLU MLPs). Computes every expert densely (tiny sizes), keeps the routed ones."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        scale_in, scale_hidden = 1 / math.sqrt(cfg.d_model), 1 / math.sqrt(cfg.d_expert)
        self.w_in = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.d_expert) * scale_in)
        self.w_out = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_expert, cfg.d_model) * scale_hidden)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [N, d] -> (y [N, d], expert ids [N, K])``, ids ordered by routing weight, highest first."""
        probs = self.gate(x).float().softmax(dim=-1)  # router probabilities in float32, as inference kernels
        weight, ids = probs.topk(self.top_k, dim=-1)  # sorted, highest first
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        hidden = F.silu(torch.einsum("nd,edh->neh", x, self.w_in))
        every = torch.einsum("neh,ehd->ned", hidden, self.w_out)  # [N, E, d]
        routed = every.gather(1, ids[:, :, None].expand(-1, -1, x.shape[-1]))  # [N, K, d]
        return (weight[:, :, None] * routed).sum(dim=1), ids


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.moe = MoE(cfg)

    def forward(
        self, x: Tensor, cache: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        a, cache = self.attn(self.norm1(x), cache)
        x = x + a
        b, t, d = x.shape
        m, ids = self.moe(self.norm2(x).reshape(b * t, d))
        return x + m.view(b, t, d), ids.view(b, t, -1), cache


class TinyMoE(nn.Module):
    """A causal MoE decoder: ``forward(tokens) -> (logits [B, T, V], experts [B, T, L, K], caches)``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(
        self, tokens: Tensor, caches: list[tuple[Tensor, Tensor]] | None = None
    ) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
        past = 0 if caches is None else caches[0][0].shape[2]
        positions = torch.arange(past, past + tokens.shape[1])
        x = self.embed(tokens) + self.pos(positions)[None]
        experts, new_caches = [], []
        for i, block in enumerate(self.blocks):
            x, ids, cache = block(x, None if caches is None else caches[i])
            experts.append(ids)
            new_caches.append(cache)
        return self.head(self.norm(x)), torch.stack(experts, dim=2), new_caches

    def score(self, prompts: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The trainer's view of sampled responses, one full-sequence pass: ``(logprobs [B, T], experts
        [B, T, L, K])`` of each response token, taken at the position whose output predicts it."""
        full = torch.cat([prompts, tokens], dim=1)
        logits, experts, _ = self(full[:, :-1])
        p, t = prompts.shape[1], tokens.shape[1]
        logp = logits[:, p - 1 :].float().log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        return logp, experts[:, p - 1 : p - 1 + t]


# -- reduced-precision rollout engines -------------------------------------------------------------------
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_available() -> str | None:
    """``None`` when this torch can cast to ``torch.float8_e4m3fn``, else why not."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch.float8_e4m3fn dtype"
    try:
        torch.ones(2).to(torch.float8_e4m3fn).float()
    except Exception as e:  # a dtype without CPU casts
        return f"torch.float8_e4m3fn casts fail on CPU ({type(e).__name__}: {e})"
    return None


def fp8_roundtrip(weight: Tensor, in_dim: int) -> Tensor:
    """Quantise ``weight`` to fp8-e4m3 with one scale per output channel (``amax`` over ``in_dim`` / 448)
    and dequantise it back to float32.

    Example:
        >>> w = torch.tensor([[1.0, -0.1, 0.013], [448.0, 3.0, 0.0]])
        >>> [[round(x, 5) for x in row] for row in fp8_roundtrip(w, in_dim=1).tolist()]  # 3 mantissa bits
        [[1.0, -0.09821, 0.01339], [448.0, 3.0, 0.0]]
    """
    scale = weight.abs().amax(dim=in_dim, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (weight / scale).to(torch.float8_e4m3fn)
    return q.float() * scale


PRECISIONS = ("bf16", "fp8")


class RolloutEngine:
    """A frozen copy of the policy's weights in a rollout precision, sampling with a KV cache.

    Args:
        policy: the trainer's fp32 model (copied, never modified).
        precision: ``"bf16"`` or ``"fp8"`` (see the module docstring).
    """

    def __init__(self, policy: TinyMoE, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        model = copy.deepcopy(policy).float()
        if precision == "fp8":
            with torch.no_grad():
                for block in model.blocks:
                    for linear in (block.attn.qkv, block.attn.out):  # [out, in]
                        linear.weight.copy_(fp8_roundtrip(linear.weight, in_dim=1))
                    block.moe.w_in.copy_(fp8_roundtrip(block.moe.w_in, in_dim=1))  # [E, in, out]
                    block.moe.w_out.copy_(fp8_roundtrip(block.moe.w_out, in_dim=1))
        self.model = model.to(torch.bfloat16).eval().requires_grad_(False)

    @torch.no_grad()
    def generate(self, prompts: Tensor, steps: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """Sample ``steps`` tokens per prompt at temperature 1.

        Returns ``(tokens [B, T], logprobs [B, T] float32, experts [B, T, L, K])``: the engine's
        log-probability of each sampled token, and the experts routed at the position that produced it
        (the same alignment as :meth:`TinyMoE.score`). After an EOS the row is filled with PAD.
        """
        logits, experts, caches = self.model(prompts)
        tokens, logps, routed = [], [], []
        done = torch.zeros(prompts.shape[0], dtype=torch.bool)
        for _ in range(steps):
            logp_all = logits[:, -1].float().log_softmax(dim=-1)
            token = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
            token = torch.where(done, torch.full_like(token, PAD), token)
            tokens.append(token)
            logps.append(logp_all.gather(1, token[:, None]).squeeze(1))
            routed.append(experts[:, -1])
            done |= token == EOS
            logits, experts, caches = self.model(token[:, None], caches)
        return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(routed, 1)
