"""The single-controller pattern with real Ray actors: workers accumulate their own collections, the driver
merges their states, and the result equals one process fed all the data. Then verl's V1 trainer hook reads
a step's batch back from a real TransferQueue running on the same Ray instance."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[integrations]')")

from opbc_metrics import OPBCCollection  # noqa: E402

pytestmark = pytest.mark.timeout(240)  # a Ray scheduling problem fails the test instead of stalling CI


def worker_batch(worker: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    b, t = 6, 7
    trainer = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    rollout = (trainer + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    mask[:, 0] = 1
    return {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask}


@ray.remote
class MetricsWorker:
    """A rollout/training worker that accumulates its own collection and ships the state to the driver."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.metrics = OPBCCollection()

    def run(self, steps: int) -> int:
        for step in range(steps):
            self.metrics.update(worker_batch(self.rank, step))
        return steps

    def state(self) -> dict[str, torch.Tensor]:
        return self.metrics.state_dict()


@pytest.fixture(scope="module")
def ray_session():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_driver_merge_of_ray_workers_equals_one_process(ray_session):
    workers = [MetricsWorker.remote(rank) for rank in range(2)]
    steps = 3
    assert ray.get([w.run.remote(steps) for w in workers]) == [steps, steps]
    driver = OPBCCollection()
    for state in ray.get([w.state.remote() for w in workers]):
        driver.merge_state(state)
    for w in workers:
        ray.kill(w)
    merged = driver.compute()

    single = OPBCCollection()
    for rank in range(2):
        for step in range(steps):
            single.update(worker_batch(rank, step))
    want = single.compute()
    assert merged.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(merged[key], want[key], rtol=1e-12, atol=1e-12, msg=key)
    # the merge is over real data: two workers' tokens
    assert merged["opbc/input/num_tokens"].item() == sum(
        int(worker_batch(r, s)["response_mask"].sum()) for r in range(2) for s in range(steps)
    )


def test_verl_v1_hook_reads_the_step_from_transfer_queue(ray_session):
    pytest.importorskip("verl", reason="verl is not installed")
    tq = pytest.importorskip("transfer_queue", reason="TransferQueue is not installed")
    from omegaconf import OmegaConf

    from opbc_metrics.integrations import verl as opbc_verl
    from tests.verl_data import TIMING_RAW, make_dataproto, v1_transfer_queue_form

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # one storage unit: the controller and the unit take the session's 2 CPUs
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        data = make_dataproto(seed=7)
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        fields = v1_transfer_queue_form(data)
        keys = [f"s{i}" for i in range(len(data))]
        meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=[{} for _ in keys])

        calls = []

        class StubV1Trainer:
            """Stands in for verl's V1 PPOTrainer: the two methods the integration wraps."""

            def _compute_advantage(self, batch, metrics):
                calls.append("adv")
                return batch

            def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
                calls.append("metrics")
                metrics["critic/score/mean"] = -1.0

        cls = opbc_verl.with_opbc(StubV1Trainer, training=True)
        trainer = cls()
        trainer.config = OmegaConf.create({"algorithm": {"use_kl_in_reward": False}})
        trainer.use_critic = True
        metrics: dict = {}
        batch = tq.KVBatchMeta(keys=keys, tags=[{} for _ in keys], partition_id="train")
        trainer._compute_advantage(batch, metrics)
        trainer._compute_metrics(batch, metrics, dict(TIMING_RAW), 1, 0)
        assert calls == ["adv", "metrics"]
        assert metrics["critic/score/mean"] == -1.0  # verl's own value stays

        reference = opbc_verl.VerlMetrics(training=True)
        reference.observe_logprobs(data)
        reference.observe_step(data, TIMING_RAW)
        want = reference.compute()
        assert meta is not None and "opbc/is/ess" in want
        for key, value in want.items():
            if key == "critic/score/mean":
                continue
            assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert trainer.opbc.report.seen == set()
    finally:
        tq.close()
