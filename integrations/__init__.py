"""Integrations with training frameworks and loggers, importable as ``opbc_metrics.integrations``.

Nothing is imported here, so the optional dependencies stay optional; import the module you need:

* :mod:`opbc_metrics.integrations.lightning` -- ``OPBCCallback`` (the ``lightning`` extra);
* :mod:`opbc_metrics.integrations.wandb_logger` -- ``OPBCWandbLogger``, ``DistributionHistograms``
  (the ``wandb`` extra);
* :mod:`opbc_metrics.integrations.dashboard` -- which keys the loggers write (one per quantity);
* :mod:`opbc_metrics.integrations.verl` -- ``verl_to_batch`` (no verl import);
* :mod:`opbc_metrics.integrations.trl` -- ``trl_to_batch`` (no TRL import).
"""
