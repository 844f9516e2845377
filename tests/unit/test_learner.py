"""The reference learner on CPU: micro-batches give the whole batch's gradient, the loss is the PPO-clip
mean worked out by hand, the KL to the starting weights, LoRA checkpoints (merged weights any backend
loads, an adapter to resume from), and options refused with a message that says what to do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM  # noqa: E402

from pipeline.errors import ConfigError  # noqa: E402
from pipeline.training.ppo import ADAPTER, LearnerOptions, PolicyGradient, micro_batches  # noqa: E402
from tests.support.learning import synthetic_batch, tiny_causal_lm  # noqa: E402

LENGTHS = [9, 23, 17, 5, 30, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    return tiny_causal_lm(tmp_path_factory.mktemp("learner") / "tiny")


def cpu(**options: object) -> LearnerOptions:
    return LearnerOptions(**{"device": "cpu", "lr": 1e-3, **options})  # type: ignore[arg-type]


def gradients(learner: PolicyGradient) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in learner.named_weights() if p.grad is not None}


def test_micro_batches_group_rows_longest_first_within_the_budget() -> None:
    assert micro_batches([9, 23, 17, 5], 0) == [[0, 1, 2, 3]]
    # 23 alone (2 x 23 > 40); 17 + 9 (2 x 17 = 34, 3 x 17 > 40); 5 starts a new group
    assert micro_batches([9, 23, 17, 5], 40) == [[1], [2, 0], [3]]
    assert micro_batches([50, 3], 10) == [[0], [1]]  # a row longer than the budget goes alone
    assert micro_batches([], 10) == []
    rows = micro_batches(LENGTHS, 48)
    assert sorted(row for group in rows for row in group) == list(range(len(LENGTHS)))
    assert all(len(group) * max(LENGTHS[r] for r in group) <= 48 or len(group) == 1 for group in rows)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_micro_batched_gradient_equals_the_whole_batchs(model_dir: Path, kl_coef: float) -> None:
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.3)
    whole = PolicyGradient(model_dir, cpu(kl_coef=kl_coef))
    parts = PolicyGradient(model_dir, cpu(kl_coef=kl_coef, micro_batch_tokens=40))
    assert len(micro_batches(LENGTHS, 40)) >= 4
    loss_whole, loss_parts = whole.accumulate(batch), parts.accumulate(batch)
    assert loss_parts == pytest.approx(loss_whole, rel=1e-5, abs=1e-7)
    assert whole.diagnostics == pytest.approx(parts.diagnostics, rel=1e-4, abs=1e-7)
    mine, theirs = gradients(whole), gradients(parts)
    assert mine.keys() == theirs.keys()
    assert len(mine) > 10
    for name, grad in mine.items():
        torch.testing.assert_close(theirs[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_loss_is_minus_the_token_mean_advantage_when_the_policy_sampled_itself(model_dir: Path) -> None:
    """Logprobs recorded by these very weights: every ratio is 1, nothing is clipped, the KL estimates are 0
    and the loss is -sum(advantage x scored tokens) / scored tokens."""
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.0)
    learner = PolicyGradient(model_dir, cpu(micro_batch_tokens=40, kl_coef=0.5))
    scored = [n - 4 for n in LENGTHS]  # the first 4 tokens of each row are its prompt
    expected = -sum(a * n for a, n in zip(batch.advantages.tolist(), scored, strict=True)) / sum(scored)
    assert learner.step(batch) == pytest.approx(expected, rel=1e-4)
    assert learner.diagnostics["kl"] == pytest.approx(0.0, abs=1e-5)
    assert learner.diagnostics["clip_fraction"] == 0.0
    assert learner.diagnostics["reference_kl"] == pytest.approx(0.0, abs=1e-6)
    learner.step(batch)  # now the weights moved from the reference's
    assert learner.diagnostics["reference_kl"] > 1e-6
    assert learner.diagnostics["kl"] > 1e-6


def test_a_full_checkpoint_resumes_the_weights_and_the_optimizer(model_dir: Path, tmp_path: Path) -> None:
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.3)
    learner = PolicyGradient(model_dir, cpu())
    learner.step(batch)
    learner.save(tmp_path / "v000001")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]  # no partial directory left
    again = PolicyGradient(tmp_path / "v000001", cpu(), base=model_dir)
    assert again.optimizer.state_dict()["state"][0]["step"] == 1
    for (name, a), (_, b) in zip(learner.named_weights(), again.named_weights(), strict=True):
        torch.testing.assert_close(b, a, msg=name)


def test_lora_trains_the_adapter_only_and_publishes_merged_weights(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.3)
    learner = PolicyGradient(model_dir, cpu(lora_rank=4, kl_coef=0.1, lr=1e-2))
    trained = dict(learner.named_weights())
    assert trained
    assert all("lora_" in name for name in trained)
    for _ in range(2):
        learner.step(batch)
    assert learner.diagnostics["reference_kl"] > 0  # the base without the adapter is the reference
    checkpoint = tmp_path / "v000002"
    learner.save(checkpoint)
    assert (checkpoint / "config.json").is_file()
    assert (checkpoint / ADAPTER / "optimizer.pt").is_file()
    merged = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    learner.model.eval()
    with torch.no_grad():
        ids, attention = batch.input_ids, batch.attention_mask
        published = merged(input_ids=ids, attention_mask=attention).logits
        trained_logits = learner.model(input_ids=ids, attention_mask=attention).logits
        before = base(input_ids=ids, attention_mask=attention).logits
    torch.testing.assert_close(published, trained_logits, rtol=1e-4, atol=1e-4)
    assert (published - before).abs().max() > 1e-3  # the published weights are not the starting ones
    resumed = PolicyGradient(checkpoint, cpu(lora_rank=4), base=model_dir)
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 2
    for (name, a), (_, b) in zip(learner.named_weights(), resumed.named_weights(), strict=True):
        torch.testing.assert_close(b, a, msg=name)


def test_lora_refuses_a_full_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    PolicyGradient(model_dir, cpu()).save(tmp_path / "v000001")
    with pytest.raises(ConfigError, match="holds no LoRA adapter"):
        PolicyGradient(tmp_path / "v000001", cpu(lora_rank=4), base=model_dir)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 0.0}, "--lr must be positive"),
        ({"clip": 1.5}, "--clip must lie between 0 and 1"),
        ({"micro_batch_tokens": -1}, "--micro-batch-tokens must be 0 or more"),
        ({"kl_coef": -0.1}, "--kl-coef must be 0 or more"),
        ({"lora_rank": -2}, "--lora-rank must be 0"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LearnerOptions(**options)  # type: ignore[arg-type]


def test_a_cuda_device_asked_for_and_absent_is_a_config_error(model_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA device"):
        PolicyGradient(model_dir, LearnerOptions(device="cuda"))


def test_waiting_batches_concatenate_into_one_right_padded_batch(model_dir: Path) -> None:
    from pipeline.training import concat_tensors

    short = synthetic_batch(model_dir, lengths=[5, 3], seed=1)
    long = synthetic_batch(model_dir, lengths=[9], seed=2)
    both = concat_tensors([short, long])
    assert both.input_ids.shape == (3, 9)
    assert both.attention_mask.sum(dim=1).tolist() == [5, 3, 9]
    assert torch.equal(both.input_ids[:2, :5], short.input_ids)
    assert both.input_ids[:2, 5:].eq(0).all()
    assert both.loss_mask[:2, 5:].eq(0).all()
    assert torch.equal(both.logprobs[2], long.logprobs[0])
    assert both.advantages.tolist() == short.advantages.tolist() + long.advantages.tolist()
    assert both.sample_ids == ["s0", "s1", "s0"]
    assert concat_tensors([short]) is short
