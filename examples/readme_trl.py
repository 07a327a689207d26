"""README snippet: the OPBC metrics in a TRL GRPO run, one import and one changed line.

``tests/test_trl_real.py`` runs :func:`train` on CPU with a tiny model; with vLLM, pass
``use_vllm=True`` in ``config`` and drop ``rollout_func``.
"""

from trl import GRPOConfig

from opbc_metrics.integrations.trl import OPBCGRPOTrainer  # was: from trl import GRPOTrainer


def train(model, tokenizer, dataset, reward_func, rollout_func=None, **config):
    trainer = OPBCGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_func,
                              train_dataset=dataset, rollout_func=rollout_func, args=GRPOConfig(**config))
    trainer.train()  # opbc/* keys join TRL's own logs (W&B, TensorBoard, ...) at every logging step
    return trainer
