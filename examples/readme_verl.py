"""README snippet: the OPBC metrics in verl 0.9 (default V1 trainer and the legacy RayPPOTrainer).

Register the wrapped trainer in the process that builds it (verl's TaskRunner), then run verl with
``trainer.v1.trainer_mode=opbc_sync``; the opbc/* and training keys join verl's own ``metrics`` each step.
"""

from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer

from opbc_metrics.integrations.verl import with_opbc

register_trainer("opbc_sync")(with_opbc(PPOTrainerSync, training=True))  # V1: trainer.v1.trainer_mode=opbc_sync
OPBCRayPPOTrainer = with_opbc(RayPPOTrainer, training=True)  # legacy: build this instead of RayPPOTrainer
