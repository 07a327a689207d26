import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# CI draws the same 40 examples per test on every run (a red CI blocks a whole submission, so a rare draw
# must not decide it); `HYPOTHESIS_PROFILE=thorough` explores: 500 fresh random examples per test.
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
