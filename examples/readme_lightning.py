from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.demos import BoringModel

from opbc_metrics.integrations.lightning import OPBCCallback


class Policy(BoringModel):  # your LightningModule: training_step returns the batch fields under "opbc"
    def training_step(self, batch, batch_idx):
        logp = self.layer(batch).log_softmax(-1)  # [B, T] trainer log-probs of the sampled tokens (with grad)
        fields = {"trainer_logprobs": logp, "rollout_logprobs": 1.01 * logp.detach()}  # the engine's: 1% off
        return {"loss": -logp.mean(), "opbc": fields}


trainer = Trainer(max_epochs=1, log_every_n_steps=16, logger=CSVLogger("."), callbacks=[OPBCCallback(key="opbc")])
trainer.fit(Policy())  # -> trainer.loggers; OPBCCallback(key="opbc", sinks=[OPBCWandbLogger()]) -> W&B instead
