"""OPBCGRPOTrainer against the real TRL GRPOTrainer: a tiny Qwen2 model built from a config and a tokenizer
built locally (no hub access), trained for a few steps on CPU in each configuration that changes what
TRL's generation batch holds. The rollout "engine" is a ``rollout_func`` that returns the model's own
logprobs minus a known offset, so the logged mismatch must read that offset."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[integrations]')")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from opbc_metrics.integrations import trl as opbc_trl  # noqa: E402
from opbc_metrics.integrations._common import OPBCIntegrationWarning  # noqa: E402
from tests.support import ROOT, load_module  # noqa: E402

VOCAB = ["<pad>", "<eos>", *[f"w{i}" for i in range(30)]]
PROMPT_LEN, COMPLETION_LEN = 4, 5
OFFSET = 0.1  # rollout logprob = trainer logprob - OFFSET, so r = trainer - rollout = +OFFSET on every token
CORE_KEYS = ("opbc/is/ess", "opbc/is/weight_mean", "opbc/logprob/abs_diff_mean", "opbc/logprob/diff_mean",
             "opbc/kl/k3", "opbc/input/num_tokens")


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def make_model():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(config)


def make_dataset(n: int = 16):
    prompts = [" ".join(f"w{(3 * i + j) % 30}" for j in range(PROMPT_LEN)) for i in range(n)]
    return datasets.Dataset.from_dict({"prompt": prompts})


def model_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """The training model's logprobs of the completion tokens (one unpadded sequence)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
    logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]
    return logps.tolist()


def rollout_func(prompts, trainer):
    """A stand-in rollout engine: fixed-length completions (no padding anywhere), and the logprobs the
    engine would report: the trainer model's own, shifted by OFFSET."""
    tok = trainer.processing_class
    gen = torch.Generator().manual_seed(len(trainer.state.log_history) + trainer._step)
    prompt_ids, completion_ids, logprobs = [], [], []
    for p in prompts:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        comp = torch.randint(2, len(VOCAB), (COMPLETION_LEN,), generator=gen).tolist()  # no EOS: no padding
        prompt_ids.append(ids)
        completion_ids.append(comp)
        logprobs.append([lp - OFFSET for lp in model_logprobs(trainer.model, ids, comp)])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def reward_len(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


class _StubVLLM:
    """Stands in for TRL's VLLMGeneration (no vLLM here): with a rollout_func, TRL only syncs weights."""

    def __init__(self, *args, **kwargs):
        self.synced = 0

    def sync_weights(self):
        self.synced += 1


def grpo_args(output_dir: str, max_steps: int, **options) -> Any:
    return trl.GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=COMPLETION_LEN, max_steps=max_steps, logging_steps=1,
                          report_to="none", save_strategy="no", use_cpu=True, seed=0, **options)


def make_trainer(args: Any, cls: Any = None, with_rollout: bool = True, **kwargs) -> Any:
    return (cls or opbc_trl.OPBCGRPOTrainer)(
        model=make_model(), reward_funcs=reward_len, args=args, train_dataset=make_dataset(),
        processing_class=make_tokenizer(), rollout_func=rollout_func if with_rollout else None, **kwargs)


def run(tmp_path, monkeypatch, *, use_vllm=False, is_correction=False, steps_per_generation=1, grad_accum=1,
        with_rollout=True, max_steps=3, controller=None, trainer_cls=None):
    if use_vllm:
        monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", _StubVLLM)
    args = grpo_args(str(tmp_path), max_steps, steps_per_generation=steps_per_generation,
                     gradient_accumulation_steps=grad_accum, learning_rate=1e-2, use_vllm=use_vllm,
                     vllm_mode="colocate", vllm_importance_sampling_correction=is_correction,
                     dataloader_num_workers=0)
    kwargs = {"opbc_controller": controller} if controller is not None else {}
    trainer = make_trainer(args, trainer_cls, with_rollout, **kwargs)
    trainer.train()
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(train_logs) == max_steps
    return trainer, train_logs


def assert_offset_read(log, slices: int = 1):
    """The mismatch keys of one logged step of ``slices`` slices of 4 completions read the known OFFSET."""
    for key in CORE_KEYS:
        assert key in log, key
    # r = +OFFSET on every token, up to float32 forward noise (batched vs one sequence)
    assert log["opbc/logprob/diff_mean"] == pytest.approx(OFFSET, abs=1e-4)
    assert log["opbc/logprob/abs_diff_mean"] == pytest.approx(OFFSET, abs=1e-4)
    assert log["opbc/is/weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(OFFSET, dtype=torch.float64))),
                                                       abs=1e-4)
    assert log["opbc/is/ess"] == pytest.approx(1.0, abs=1e-6)
    assert log["opbc/input/num_tokens"] == slices * 4 * COMPLETION_LEN


def test_no_vllm_steps_per_generation_1_uses_the_loss_logprobs(tmp_path, monkeypatch):
    # TRL computes no old_per_token_logps here (the situation that crashed the docstring recipe).
    _, logs = run(tmp_path, monkeypatch)
    for log in logs:
        assert_offset_read(log)
    assert "opbc/sequence/log_ratio_mean" in logs[0]
    assert logs[0]["opbc/sequence/log_ratio_mean"] == pytest.approx(COMPLETION_LEN * OFFSET, abs=1e-3)


def test_aligned_steps_per_generation_2_captures_every_shuffled_slice(tmp_path, monkeypatch):
    _, logs = run(tmp_path, monkeypatch, steps_per_generation=2, grad_accum=2, max_steps=2)
    for log in logs:
        assert_offset_read(log, slices=2)


def test_misaligned_generation_feeds_from_trls_old_logprobs_and_skips_windows_without_data(tmp_path, monkeypatch):
    # steps_per_generation=2 with no accumulation: TRL computes old_per_token_logps at generation; the second
    # step of each generation has no new batch, so its log must carry no opbc key.
    _, logs = run(tmp_path, monkeypatch, steps_per_generation=2, max_steps=4)
    with_keys = [i for i, log in enumerate(logs) if any(k.startswith("opbc/") for k in log)]
    assert with_keys == [0, 2]
    for i in with_keys:
        assert_offset_read(logs[i], slices=2)


@pytest.mark.parametrize("is_correction", [True, False], ids=["with_is_correction", "without_is_correction"])
def test_vllm(tmp_path, monkeypatch, is_correction):
    trainer, logs = run(tmp_path, monkeypatch, use_vllm=True, is_correction=is_correction)
    assert trainer.vllm_generation.synced >= 1
    for log in logs:
        assert_offset_read(log)
        # with the correction, TRL's own view of the same tokens agrees: |old - sampling| mean
        trls = log.get("sampling/sampling_logp_difference/mean")
        assert trls == (pytest.approx(log["opbc/logprob/abs_diff_mean"], abs=1e-5) if is_correction else None)


def test_batches_without_rollout_logprobs_are_reported_once_and_log_nothing(tmp_path, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, logs = run(tmp_path, monkeypatch, with_rollout=False, max_steps=2)
    ours = [w for w in caught if issubclass(w.category, OPBCIntegrationWarning)]
    assert len(ours) == 1 and "sampling_per_token_logps" in str(ours[0].message)
    for log in logs:
        assert not any(k.startswith(("opbc/", "per_round/")) for k in log), sorted(log)


def test_controller_weights_replace_trls_is_ratio_and_decisions_are_logged(tmp_path, monkeypatch):
    seen = []

    class Spy(opbc_trl.OPBCGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append((inputs["importance_sampling_ratio"].clone(), inputs["tool_mask"].clone()))
            return super()._compute_loss(model, inputs)

    _, logs = run(tmp_path, monkeypatch, use_vllm=True, is_correction=True, controller="default",
                        trainer_cls=Spy, max_steps=2)
    assert seen
    for ratio, mask in seen:
        # every group is healthy (r = 0.1 everywhere): train, weight 1 per token instead of TRL's exp(0.1)
        assert torch.allclose(ratio, torch.ones_like(ratio))
        assert bool((mask == 1).all())
    assert len(logs) == 2
    for log in logs:  # each step's own decisions (the budget restarts after each log): 2 groups of 2 completions
        assert log["opbc/decision/group_share/train"] == 1.0
        assert log["opbc/decision/num_groups"] == 2 and log["opbc/decision/num_tokens"] == 4 * COMPLETION_LEN
        assert_offset_read(log)


def test_with_opbc_wraps_a_subclass_and_the_module_imports_without_trl_access():
    class MyGRPO(trl.GRPOTrainer):
        pass

    wrapped = opbc_trl.with_opbc(MyGRPO)
    assert issubclass(wrapped, MyGRPO) and issubclass(wrapped, opbc_trl.OPBCTrainerMixin)
    assert opbc_trl.with_opbc(wrapped) is wrapped
    assert issubclass(opbc_trl.OPBCGRPOTrainer, trl.GRPOTrainer)
    with pytest.raises(TypeError):
        opbc_trl.with_opbc("GRPOTrainer")


def test_readme_snippet_trains_and_logs(tmp_path):
    trainer = load_module("readme_trl").train(
        make_model(), make_tokenizer(), make_dataset(), reward_len, rollout_func=rollout_func,
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=COMPLETION_LEN, max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True,
    )
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert_offset_read(log)


def _ddp_worker(rank: int, world: int, out: str, port: str) -> None:
    """One process of a 2-process (gloo) GRPO run; writes its training logs to ``out``, then exits the process."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    # ddp_timeout: a collective that the other process never joins fails here within 2 minutes, with its
    # traceback in this process's output, instead of waiting out torch's default 30
    trainer = make_trainer(grpo_args(f"{out}/r{rank}", 2, ddp_backend="gloo", ddp_timeout=120))
    trainer.train()
    assert trainer.accelerator.num_processes == world
    with open(f"{out}/logs{rank}.json", "w") as f:
        json.dump([h for h in trainer.state.log_history if "loss" in h], f)
    # The process group goes before the interpreter: left to exit, gloo's threads once aborted a worker
    # ("terminate called without an active exception", return code -6) after its logs were written.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Then leave without freeing the trainer: freed once the other process had exited, it hung a worker in C++
    # destructors (3 runs of 9 here, and once in CI; faulthandler showed the caller's line, no frame below it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tails(outputs: list[bytes]) -> str:
    return "\n".join(f"--- process {r} ---\n" + out.decode(errors="replace")[-3000:] for r, out in enumerate(outputs))


def test_two_processes_log_the_synced_values_on_every_process(tmp_path):
    """compute() is a collective: every process reaches it in TRL's log(), and all log the same synced values."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_trl_real", str(r), "2", str(tmp_path), port],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    deadline = time.monotonic() + 300
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:  # kill both, then fail with what each printed (a hang must say where)
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        pytest.fail("the 2-process GRPO run did not finish in 300 s:\n" + _tails(outputs))
    assert [p.returncode for p in procs] == [0, 0], _tails(outputs)
    logs = [json.loads((tmp_path / f"logs{r}.json").read_text()) for r in range(2)]
    assert len(logs[0]) == len(logs[1]) == 2
    for a, b in zip(*logs):
        ours = sorted(k for k in a if k.startswith("opbc/"))
        assert ours and ours == sorted(k for k in b if k.startswith("opbc/"))
        for k in ours:
            assert a[k] == b[k], k
        assert_offset_read(a, slices=2)  # both processes' tokens


if __name__ == "__main__":
    _ddp_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])


def test_generation_group_ids_number_prompts_across_processes():
    """Each process's rows get the ids of their prompts in the globally ordered generation batch (TRL's
    RepeatSampler keeps a prompt's completions together there): process p's rows are global rows p * B .. (p + 1) * B
    - 1, a group may straddle two processes, and no two processes' different prompts share an id."""
    for world, batch_size, generations in ((1, 4, 2), (2, 4, 2), (3, 3, 2), (2, 6, 3), (4, 2, 4)):
        ids = torch.cat([opbc_trl.generation_group_ids(batch_size, generations, p) for p in range(world)])
        assert ids.tolist() == [row // generations for row in range(world * batch_size)]
