from lightning.pytorch import Trainer, loggers
from lightning.pytorch.demos import BoringModel

from opbc_metrics.integrations.lightning import OPBCCallback


class Policy(BoringModel):  # your LightningModule: training_step returns the batch fields under "opbc"
    def training_step(self, batch, batch_idx):
        logp = self.layer(batch).log_softmax(-1)  # [B, T] trainer log-probs of the sampled tokens (with grad)
        fields = {"trainer_logprobs": logp, "rollout_logprobs": 1.01 * logp.detach()}  # the engine's: 1% off
        return {"loss": -logp.mean(), "opbc": fields}


callback = OPBCCallback(key="opbc")  # -> trainer.loggers; OPBCCallback(key="opbc", sinks=[OPBCWandbLogger()]) -> W&B
Trainer(max_epochs=1, log_every_n_steps=16, logger=loggers.CSVLogger("."), callbacks=[callback]).fit(Policy())
