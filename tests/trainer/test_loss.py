"""DAPO loss pieces against values worked out by hand."""

import math

import pytest
import torch

from rollstream.trainer.loss import dapo_policy_loss, group_advantages, overlong_penalty


def _logs(ratios):
    return torch.log(torch.tensor(ratios, dtype=torch.float64))


@pytest.fixture
def handcrafted():
    # seq 0, advantage +1: ratios 1.5 (clipped high at 1.28), 1.25 (inside clip-higher,
    #   would be clipped by a symmetric 0.2), then a masked token with a huge ratio.
    # seq 1, advantage -1: ratios 0.5 (clipped low at 0.8), 0.9, 1.2 (unclipped: min picks r*A)
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=torch.float64)
    ratios = torch.tensor([[1.5, 1.25, math.exp(40.0)], [0.5, 0.9, 1.2]], dtype=torch.float64)
    logprobs = (behaviour + torch.log(ratios)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return logprobs, behaviour, advantages, mask


def test_loss_equals_hand_computed_value_with_clip_higher_on_both_sides(handcrafted):
    logprobs, behaviour, advantages, mask = handcrafted
    out = dapo_policy_loss(logprobs, behaviour, advantages, mask, clip_low=0.2, clip_high=0.28)
    # -1.28 - 1.25 + 0.8 + 0.9 + 1.2, over the 5 unmasked tokens of the whole batch
    assert out.loss.item() == pytest.approx(0.37 / 5, abs=1e-9)
    assert out.metrics["clip_frac"] == pytest.approx(2 / 5)
    assert out.metrics["clip_high_frac"] == pytest.approx(1 / 5)
    assert out.metrics["clip_low_frac"] == pytest.approx(1 / 5)
    assert out.metrics["tokens"] == 5


def test_loss_is_token_level_not_sequence_level(handcrafted):
    logprobs, behaviour, advantages, mask = handcrafted
    out = dapo_policy_loss(logprobs, behaviour, advantages, mask)
    sequence_mean = ((-1.28 - 1.25) / 2 + (0.8 + 0.9 + 1.2) / 3) / 2
    assert out.loss.item() != pytest.approx(sequence_mean, abs=1e-6)
    # a caller that sees a micro-batch passes the token count of the whole batch
    half = dapo_policy_loss(logprobs[:1], behaviour[:1], advantages[:1], mask[:1], num_tokens=5)
    assert half.loss.item() == pytest.approx((-1.28 - 1.25) / 5)


def test_clipped_and_masked_tokens_get_no_gradient(handcrafted):
    logprobs, behaviour, advantages, mask = handcrafted
    dapo_policy_loss(logprobs, behaviour, advantages, mask).loss.backward()
    grad = logprobs.grad
    # d(-r*A/5)/dlogp = -r*A/5 where unclipped; 0 where clipped or masked
    expected = torch.tensor([[0.0, -1.25 / 5, 0.0], [0.0, 0.9 / 5, 1.2 / 5]], dtype=torch.float64)
    assert torch.allclose(grad, expected, atol=1e-9)
    assert torch.isfinite(grad).all()


def test_masked_tokens_do_not_change_the_loss(handcrafted):
    logprobs, behaviour, advantages, mask = handcrafted
    base = dapo_policy_loss(logprobs, behaviour, advantages, mask).loss.item()
    other = logprobs.detach().clone()
    other[0, 2] = -123.0
    assert dapo_policy_loss(other, behaviour, advantages, mask).loss.item() == pytest.approx(base)


def test_truncated_importance_weight_caps_the_old_to_behaviour_ratio():
    behaviour = torch.zeros(1, 2, dtype=torch.float64)
    old = torch.log(torch.tensor([[3.0, 0.5]], dtype=torch.float64))  # trainer/rollout mismatch
    logprobs = old.clone()  # ratio 1 against the proximal (old) policy
    mask = torch.ones(1, 2, dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    out = dapo_policy_loss(logprobs, behaviour, adv, mask, old_logprobs=old, tis_cap=2.0)
    # weights min(3, 2) = 2 and min(0.5, 2) = 0.5; per-token loss -1 * weight
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.25)
    without = dapo_policy_loss(logprobs, behaviour, adv, mask, old_logprobs=old)
    assert without.loss.item() == pytest.approx(-1.0)


def test_kl_to_reference_is_off_by_default_and_added_when_asked():
    logprobs = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    adv = torch.tensor([0.0], dtype=torch.float64)
    off = dapo_policy_loss(logprobs, logprobs, adv, mask, ref_logprobs=ref)
    assert off.loss.item() == 0.0
    on = dapo_policy_loss(logprobs, logprobs, adv, mask, ref_logprobs=ref, kl_coef=0.5)
    k3 = math.exp(-1.0) + 1.0 - 1.0  # exp(d) - d - 1 with d = -1
    assert on.loss.item() == pytest.approx(0.5 * k3 / 2)


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 9])
    adv = group_advantages(rewards, groups)
    z = 0.5 / math.sqrt(1 / 3)  # mean 0.5, unbiased std sqrt(1/3)
    assert torch.allclose(adv, torch.tensor([z, -z, -z, z, 0.0, 0.0, 0.0]), atol=1e-5)


def test_overlong_penalty_is_zero_then_linear_then_minus_one():
    lengths = torch.tensor([50, 80, 90, 100, 130])
    penalty = overlong_penalty(lengths, max_response_tokens=100, overlong_buffer_tokens=20)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 100, 20, penalty_factor=0.5).tolist() == pytest.approx([0, 0, -0.25, -0.5, -0.5])
