import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.integrations.wandb_logger import OPBCWandbLogger

metrics, logger = OPBCCollection(), OPBCWandbLogger(project="opbc", mode="offline")  # joins an active run if any
for step in range(10):
    trainer_logp = -torch.rand(8, 128)  # log-probs of the sampled tokens under the trainer; the engine's differ a bit
    metrics.update(trainer_logprobs=trainer_logp, rollout_logprobs=trainer_logp - 0.01 * torch.rand(8, 128))
    logger.log(metrics.compute(), step=step)  # compute() on every rank (one collective), rank 0 writes
    metrics.reset()
logger.finish()  # ends the run only if the logger started it
