"""Integrations with training frameworks and loggers, importable as ``opbc_metrics.integrations``.

Nothing is imported here, so the optional dependencies stay optional; import the module you need:

* :mod:`opbc_metrics.integrations.lightning` -- ``OPBCCallback`` (the ``lightning`` extra);
* :mod:`opbc_metrics.integrations.wandb_logger` -- ``OPBCWandbLogger``, ``DistributionHistograms``
  (the ``wandb`` extra);
* :mod:`opbc_metrics.integrations.dashboard` -- which keys the loggers write (one per quantity);
* :mod:`opbc_metrics.integrations.verl` -- ``with_opbc`` for verl's trainers, ``VerlMetrics``, ``verl_to_batch``
  (the ``integrations`` extra; importing the module does not import verl);
* :mod:`opbc_metrics.integrations.trl` -- ``OPBCGRPOTrainer``, ``with_opbc``, ``trl_to_batch`` (TRL is
  imported on first use of the trainer class).
"""
