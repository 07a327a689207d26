"""Lightning + OPBCCallback (+ optional offline W&B): mismatch metrics of a bf16 "rollout engine".

A tiny policy (embedding -> linear over a 64-token vocabulary) samples one token per position with
its own weights cast to bfloat16 -- the rollout engine -- and trains in float32 with a REINFORCE
loss. The logprob mismatch the callback measures is therefore real (bf16 rounding of the same
weights), not injected noise. ``training_step`` returns the batch-schema fields under ``"opbc"``;
the callback logs the global values every ``--log-every`` batches to the trainer's logger (CSV).

Run: ``python examples/lightning_example.py`` (CPU, a few seconds), or with ``--wandb-dir runs`` to
log to an offline W&B run instead (``wandb sync`` it later if you want): Lightning's ``WandbLogger``
starts the run and logs ``train/loss``; an ``OPBCWandbLogger`` sink joins that run and writes the OPBC
keys (summaries, histograms, the glossary table), and the callback writes only to the sink.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn

from opbc_metrics import OPBCCollection
from opbc_metrics.integrations.lightning import OPBCCallback

VOCAB, DIM, SEQ = 64, 32, 24


class ToyPolicy(L.LightningModule):
    """Holds its OPBCCollection (moved and checkpointed with the module); rewards even tokens."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.lr = lr
        self.opbc = OPBCCollection(sections=("mismatch",))

    def logits(self, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        emb = nn.functional.embedding(tokens, self.embed.weight.to(dtype))
        return nn.functional.linear(torch.tanh(emb), self.head.weight.to(dtype), self.head.bias.to(dtype))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        prompts, mask = batch["prompts"], batch["response_mask"]
        with torch.no_grad():  # the rollout engine: same weights in bf16, sampling
            rollout_logp_all = torch.log_softmax(self.logits(prompts, torch.bfloat16).float(), dim=-1)
            actions = torch.distributions.Categorical(logits=rollout_logp_all).sample()
            rollout_logprobs = rollout_logp_all.gather(-1, actions[..., None])[..., 0]
        trainer_logprobs = torch.log_softmax(self.logits(prompts), dim=-1).gather(-1, actions[..., None])[..., 0]
        reward = ((actions % 2 == 0).float() * mask).sum(1) / mask.sum(1).clamp_min(1)
        advantage = reward - reward.mean()
        loss = -(advantage[:, None] * trainer_logprobs * mask).sum() / mask.sum().clamp_min(1)
        self.log("train/loss", loss, on_step=True, batch_size=prompts.shape[0])
        return {
            "loss": loss,
            "opbc": {"trainer_logprobs": trainer_logprobs, "rollout_logprobs": rollout_logprobs, "response_mask": mask},
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def toy_data(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, SEQ + 1, (n,), generator=g)
    return [
        {"prompts": torch.randint(0, VOCAB, (SEQ,), generator=g), "response_mask": (torch.arange(SEQ) < length).long()}
        for length in lengths
    ]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16, help="training batches per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--wandb-dir", default=None, help="also write an offline W&B run here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    sinks: list[Any] = []
    logger: Any = L.loggers.CSVLogger("lightning_logs", name="opbc_example")
    if args.wandb_dir:
        from opbc_metrics.integrations.wandb_logger import DistributionHistograms, OPBCWandbLogger

        logger = L.loggers.WandbLogger(project="opbc-lightning-example", save_dir=args.wandb_dir, offline=True)
        # No run argument: it joins the run Lightning's WandbLogger started, and leaves it to Lightning.
        sinks.append(OPBCWandbLogger(distributions=DistributionHistograms(bins=64, log_ratio_range=0.05)))
    callback = OPBCCallback("opbc", key="opbc", log_every_n_steps=args.log_every, sinks=sinks)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=[callback],
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        log_every_n_steps=args.log_every,
    )
    data = torch.utils.data.DataLoader(toy_data(8 * args.batches), batch_size=8)
    trainer.fit(ToyPolicy(), data)
    for sink in sinks:
        sink.finish()  # detaches; the run is Lightning's
    if args.wandb_dir:
        import wandb

        wandb.finish()
    out = {k: v.item() for k, v in callback.epoch_values.items()}
    for key in ("opbc/is/ess", "opbc/logprob/abs_diff_mean", "opbc/logprob/abs_diff_max", "opbc/kl/k3"):
        print(f"{key:<28} {out[key]: .6g}   (last epoch, bf16 rollout vs fp32 trainer)")
    return out


if __name__ == "__main__":
    main()
