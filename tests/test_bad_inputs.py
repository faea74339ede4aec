"""Bad input (DESIGN.md): a ValueError or TypeError whose message names the argument, for
every public function, raised before any kernel runs. And the near misses that must NOT
raise (out-of-range token ids on masked positions, boundary values of the ranges)."""

import math

import pytest
import torch

import ppo_kernels as pk

from conftest import HAS_CUDA_DEVICE

B, T, V = 2, 3, 5


def base_ppo():
    g = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(B, T, V, generator=g), tokens=torch.randint(0, V, (B, T),
                                                                               generator=g),
                old_logprobs=-torch.rand(B, T, generator=g) - 1,
                advantages=torch.randn(B, T, generator=g),
                response_mask=torch.ones(B, T, dtype=torch.bool),
                ref_logprobs=-torch.rand(B, T, generator=g) - 1, backend="cpu")


def base_tlp():
    d = base_ppo()
    return dict(logits=d["logits"], tokens=d["tokens"], response_mask=d["response_mask"],
                backend="cpu")


def base_gae():
    return dict(rewards=torch.randn(B, T), values=torch.randn(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool), backend="cpu")


def base_klr():
    return dict(scores=torch.randn(B), logprobs=-torch.rand(B, T), ref_logprobs=-torch.rand(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool), kl_coef=0.1)


def base_whiten():
    return dict(x=torch.randn(B, T), response_mask=torch.ones(B, T, dtype=torch.bool))


def base_score():
    d = base_ppo()
    return dict(logits=d["logits"], tokens=d["tokens"], ref_logprobs=d["ref_logprobs"],
                values=torch.randn(B, T), scores=torch.randn(B),
                response_mask=d["response_mask"], kl_coef=0.1, backend="cpu")


def base_vl():
    return dict(values=torch.randn(B, T), old_values=torch.randn(B, T), returns=torch.randn(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool))


FUNCS = {"ppo_loss": (pk.ppo_loss, base_ppo), "token_logprobs": (pk.token_logprobs, base_tlp),
         "gae": (pk.gae, base_gae), "kl_penalized_rewards": (pk.kl_penalized_rewards, base_klr),
         "whiten": (pk.whiten, base_whiten), "score_rollout": (pk.score_rollout, base_score),
         "value_loss": (pk.value_loss, base_vl)}

META = torch.device("meta")


def oob(value, pos=(1, 2)):
    def f(d):
        t = d["tokens"].clone()
        t[pos] = value
        return t
    return f


# (function, argument to replace, new value or f(base dict) -> value, exception, match)
ROWS = [
    # ---------------- ppo_loss
    ("ppo_loss", "logits", torch.randn(B, T, V, 2), ValueError, "logits"),
    ("ppo_loss", "logits", torch.randn(V), ValueError, "logits"),
    ("ppo_loss", "logits", torch.zeros(B, T, V, dtype=torch.int32), TypeError, "logits"),
    ("ppo_loss", "logits", torch.zeros(B, T, V, dtype=torch.complex64), TypeError, "logits"),
    ("ppo_loss", "logits", [[[0.0] * V] * T] * B, TypeError, "logits"),
    ("ppo_loss", "logits", torch.zeros(B, T, 0), ValueError, "logits"),
    ("ppo_loss", "tokens", torch.zeros(B, T), TypeError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B, T, dtype=torch.bool), TypeError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B, T + 2, dtype=torch.long), ValueError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B + 1, T, dtype=torch.long), ValueError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B * T, dtype=torch.long), ValueError, "tokens"),
    ("ppo_loss", "tokens", [[0] * T] * B, TypeError, "tokens"),
    ("ppo_loss", "tokens", oob(V), ValueError, "tokens"),
    ("ppo_loss", "tokens", oob(-1), ValueError, "tokens"),
    ("ppo_loss", "tokens", oob(10**6, (0, 0)), ValueError, "tokens"),
    ("ppo_loss", "old_logprobs", torch.zeros(B, T + 1), ValueError, "old_logprobs"),
    ("ppo_loss", "old_logprobs", torch.zeros(B, T, dtype=torch.long), TypeError, "old_logprobs"),
    ("ppo_loss", "old_logprobs", "x", TypeError, "old_logprobs"),
    ("ppo_loss", "old_logprobs", 0.5, TypeError, "old_logprobs"),
    ("ppo_loss", "advantages", torch.zeros(T, B), ValueError, "advantages"),
    ("ppo_loss", "advantages", torch.zeros(B, T, dtype=torch.int64), TypeError, "advantages"),
    ("ppo_loss", "response_mask", torch.ones(B, T + 1, dtype=torch.bool), ValueError,
     "response_mask"),
    ("ppo_loss", "response_mask", "all", TypeError, "response_mask"),
    ("ppo_loss", "ref_logprobs", torch.zeros(B, 1), ValueError, "ref_logprobs"),
    ("ppo_loss", "rollout_is_weights", torch.ones(B + 1), ValueError, "rollout_is_weights"),
    ("ppo_loss", "rollout_is_weights", torch.ones(B, T, dtype=torch.int32), TypeError,
     "rollout_is_weights"),
    ("ppo_loss", "loss_agg_mode", "mean", ValueError, "loss_agg_mode"),
    ("ppo_loss", "loss_agg_mode", "seq-mean", ValueError, "loss_agg_mode"),
    ("ppo_loss", "kl_estimator", "k4", ValueError, "kl_estimator"),
    ("ppo_loss", "kl_estimator", "K3", ValueError, "kl_estimator"),
    ("ppo_loss", "backend", "gpu", ValueError, "backend"),
    ("ppo_loss", "backend", "cuda", ValueError, "backend"),
    ("ppo_loss", "backend", None, ValueError, "backend"),
    ("ppo_loss", "temperature", 0.0, ValueError, "temperature"),
    ("ppo_loss", "temperature", -1.0, ValueError, "temperature"),
    ("ppo_loss", "temperature", math.nan, ValueError, "temperature"),
    ("ppo_loss", "temperature", math.inf, ValueError, "temperature"),
    ("ppo_loss", "temperature", "1.0", TypeError, "temperature"),
    # 1 / temperature overflows float32 (the accumulation type of float32 logits)
    ("ppo_loss", "temperature", 1e-39, ValueError, "temperature"),
    ("ppo_loss", "temperature", 5e-324, ValueError, "temperature"),
    ("ppo_loss", "grad_scale", 0.0, ValueError, "grad_scale"),
    ("ppo_loss", "grad_scale", -1.0, ValueError, "grad_scale"),
    ("ppo_loss", "grad_scale", math.inf, ValueError, "grad_scale"),
    ("ppo_loss", "grad_scale", torch.tensor(0.5), TypeError, "grad_scale"),
    ("ppo_loss", "clip_eps_low", -0.1, ValueError, "clip_eps_low"),
    ("ppo_loss", "clip_eps_low", 1.0, ValueError, "clip_eps_low"),
    ("ppo_loss", "clip_eps_high", 1.0, ValueError, "clip_eps_high"),
    ("ppo_loss", "clip_eps_high", -0.2, ValueError, "clip_eps_high"),
    ("ppo_loss", "dual_clip_c", 1.0, ValueError, "dual_clip_c"),
    ("ppo_loss", "dual_clip_c", 0.5, ValueError, "dual_clip_c"),
    ("ppo_loss", "dual_clip_c", -3.0, ValueError, "dual_clip_c"),
    # at or below 1 + clip_eps_high (0.2) the cap cuts into the clip band
    ("ppo_loss", "dual_clip_c", 1.2, ValueError, "dual_clip_c"),
    ("ppo_loss", "policy_loss", "ppo", ValueError, "policy_loss"),
    ("ppo_loss", "policy_loss", "GSPO", ValueError, "policy_loss"),
    ("ppo_loss", "sapo_tau_pos", 0.0, ValueError, "sapo_tau_pos"),
    ("ppo_loss", "sapo_tau_neg", -1.0, ValueError, "sapo_tau_neg"),
    ("ppo_loss", "clip_eps_high", 2.0, ValueError, "clip_eps_high"),  # fine for cispo only
    ("ppo_loss", "kl_bias_correction", "yes", TypeError, "kl_bias_correction"),
    ("ppo_loss", "kl_estimator", "k2+", ValueError, "kl_estimator"),
    ("ppo_loss", "entropy_agg_mode", "none", ValueError, "entropy_agg_mode"),
    ("ppo_loss", "entropy_agg_mode", "mean", ValueError, "entropy_agg_mode"),
    ("ppo_loss", "advantages", torch.zeros(B + 1), ValueError, "advantages"),
    ("ppo_loss", "advantages", torch.zeros(B, 2), ValueError, "advantages"),
    ("ppo_loss", "rollout_is_weights", torch.ones(B, 2), ValueError, "rollout_is_weights"),
    ("ppo_loss", "global_num_tokens", torch.tensor([3.0, 4.0]), ValueError, "global_num_tokens"),
    ("ppo_loss", "global_num_tokens", torch.tensor(0.0), ValueError, "global_num_tokens"),
    ("ppo_loss", "global_num_tokens", torch.tensor(True), TypeError, "global_num_tokens"),
    ("ppo_loss", "global_num_seqs", 0, ValueError, "global_num_seqs"),
    ("ppo_loss", "global_num_seqs", torch.tensor(-2), ValueError, "global_num_seqs"),
    ("ppo_loss", "kl_coef", -0.1, ValueError, "kl_coef"),
    ("ppo_loss", "kl_coef", math.nan, ValueError, "kl_coef"),
    ("ppo_loss", "entropy_coef", "0.1", TypeError, "entropy_coef"),
    ("ppo_loss", "entropy_coef", math.inf, ValueError, "entropy_coef"),
    ("ppo_loss", "global_num_tokens", 0, ValueError, "global_num_tokens"),
    ("ppo_loss", "global_num_tokens", -4, ValueError, "global_num_tokens"),
    ("ppo_loss", "norm_length", 0, ValueError, "norm_length"),
    ("ppo_loss", "norm_length", -1.5, ValueError, "norm_length"),
    ("ppo_loss", "inplace_backward", "yes", TypeError, "inplace_backward"),
    ("ppo_loss", "tokens", lambda d: d["tokens"].to(META), ValueError, "tokens"),
    ("ppo_loss", "old_logprobs", lambda d: d["old_logprobs"].to(META), ValueError,
     "old_logprobs"),
    ("ppo_loss", "advantages", lambda d: d["advantages"].to(META), ValueError, "advantages"),
    ("ppo_loss", "response_mask", lambda d: d["response_mask"].to(META), ValueError,
     "response_mask"),
    ("ppo_loss", "ref_logprobs", lambda d: d["ref_logprobs"].to(META), ValueError,
     "ref_logprobs"),
    # ---------------- token_logprobs
    ("token_logprobs", "logits", torch.zeros(B, T, V, dtype=torch.int64), TypeError, "logits"),
    ("token_logprobs", "logits", torch.zeros(B, T, 0), ValueError, "logits"),
    ("token_logprobs", "logits", torch.zeros(B, T + 2, V), ValueError, "tokens"),
    ("token_logprobs", "logits", None, TypeError, "logits"),
    ("token_logprobs", "tokens", torch.zeros(B, T, dtype=torch.float16), TypeError, "tokens"),
    ("token_logprobs", "tokens", oob(V), ValueError, "tokens"),
    ("token_logprobs", "tokens", oob(-2), ValueError, "tokens"),
    ("token_logprobs", "tokens", lambda d: d["tokens"].to(META), ValueError, "tokens"),
    ("token_logprobs", "response_mask", torch.ones(T, B), ValueError, "response_mask"),
    ("token_logprobs", "temperature", 0, ValueError, "temperature"),
    ("token_logprobs", "temperature", -0.5, ValueError, "temperature"),
    ("token_logprobs", "temperature", 2e-39, ValueError, "temperature"),
    ("token_logprobs", "return_entropy", "yes", TypeError, "return_entropy"),
    ("token_logprobs", "backend", "tpu", ValueError, "backend"),
    ("token_logprobs", "backend", "cuda", ValueError, "backend"),
    # ---------------- gae
    ("gae", "rewards", torch.randn(B * T), ValueError, "rewards"),
    ("gae", "rewards", torch.randn(B, T, 1), ValueError, "rewards"),
    ("gae", "rewards", torch.ones(B, T, dtype=torch.int32), TypeError, "rewards"),
    ("gae", "rewards", [[0.0] * T] * B, TypeError, "rewards"),
    ("gae", "values", torch.randn(B, T + 1), ValueError, "values"),
    ("gae", "values", torch.ones(B, T, dtype=torch.long), TypeError, "values"),
    ("gae", "values", None, TypeError, "values"),
    ("gae", "values", lambda d: d["values"].to(META), ValueError, "values"),
    ("gae", "response_mask", torch.ones(B + 1, T), ValueError, "response_mask"),
    ("gae", "gamma", 1.01, ValueError, "gamma"),
    ("gae", "gamma", -0.01, ValueError, "gamma"),
    ("gae", "lam", 1.5, ValueError, "lam"),
    ("gae", "lam", -1.0, ValueError, "lam"),
    ("gae", "lam", math.nan, ValueError, "lam"),
    ("gae", "bootstrap_values", torch.zeros(B, 1), ValueError, "bootstrap_values"),
    ("gae", "bootstrap_values", torch.zeros(B + 1), ValueError, "bootstrap_values"),
    ("gae", "bootstrap_values", torch.zeros(B, dtype=torch.long), TypeError,
     "bootstrap_values"),
    ("gae", "bootstrap_values", torch.zeros(B, device=META), ValueError, "bootstrap_values"),
    ("gae", "backend", "fast", ValueError, "backend"),
    ("gae", "backend", "cuda", ValueError, "backend"),
    # ---------------- kl_penalized_rewards
    ("kl_penalized_rewards", "scores", torch.zeros(B, 1), ValueError, "scores"),
    ("kl_penalized_rewards", "scores", torch.zeros(B + 1), ValueError, "scores"),
    ("kl_penalized_rewards", "scores", torch.zeros(B, dtype=torch.long), TypeError, "scores"),
    ("kl_penalized_rewards", "scores", 1.0, TypeError, "scores"),
    ("kl_penalized_rewards", "logprobs", torch.zeros(B, T, 2), ValueError, "logprobs"),
    ("kl_penalized_rewards", "ref_logprobs", torch.zeros(B, T + 1), ValueError, "ref_logprobs"),
    ("kl_penalized_rewards", "response_mask", torch.ones(B, T - 1), ValueError,
     "response_mask"),
    ("kl_penalized_rewards", "kl_coef", -1.0, ValueError, "kl_coef"),
    ("kl_penalized_rewards", "kl_coef", None, TypeError, "kl_coef"),
    ("kl_penalized_rewards", "kl_estimator", "kl", ValueError, "kl_estimator"),
    # ---------------- whiten
    ("whiten", "x", torch.ones(B, T, dtype=torch.long), TypeError, "x"),
    ("whiten", "x", [1.0, 2.0], TypeError, "x"),
    ("whiten", "response_mask", torch.ones(B, T + 1), ValueError, "response_mask"),
    ("whiten", "response_mask", lambda d: d["response_mask"].to(META), ValueError,
     "response_mask"),
    ("whiten", "eps", -1e-8, ValueError, "eps"),
    # ---------------- score_rollout
    ("score_rollout", "logits", torch.randn(B * T, V), ValueError, "logits"),
    ("score_rollout", "logits", torch.zeros(B, T, V, dtype=torch.int8), TypeError, "logits"),
    ("score_rollout", "logits", torch.zeros(B, T, 0), ValueError, "logits"),
    ("score_rollout", "tokens", torch.zeros(B, T), TypeError, "tokens"),
    ("score_rollout", "tokens", oob(V), ValueError, "tokens"),
    ("score_rollout", "ref_logprobs", torch.zeros(B, T - 1), ValueError, "ref_logprobs"),
    ("score_rollout", "ref_logprobs", None, TypeError, "ref_logprobs"),
    ("score_rollout", "values", torch.zeros(B, T + 1), ValueError, "values"),
    ("score_rollout", "scores", torch.zeros(B, T), ValueError, "scores"),
    ("score_rollout", "response_mask", torch.ones(1, T), ValueError, "response_mask"),
    ("score_rollout", "kl_coef", -0.5, ValueError, "kl_coef"),
    ("score_rollout", "kl_estimator", "k0", ValueError, "kl_estimator"),
    ("score_rollout", "gamma", 2.0, ValueError, "gamma"),
    ("score_rollout", "lam", -0.5, ValueError, "lam"),
    ("score_rollout", "temperature", 0.0, ValueError, "temperature"),
    ("score_rollout", "temperature", 1e-40, ValueError, "temperature"),
    ("score_rollout", "whiten", "no", TypeError, "whiten"),
    ("score_rollout", "backend", "cuda", ValueError, "backend"),
    ("score_rollout", "backend", "numpy", ValueError, "backend"),
    ("score_rollout", "values", lambda d: d["values"].to(META), ValueError, "values"),
    # ---------------- value_loss
    ("value_loss", "values", torch.randn(B, T, 1), ValueError, "values"),
    ("value_loss", "values", torch.ones(B, T, dtype=torch.long), TypeError, "values"),
    ("value_loss", "values", None, TypeError, "values"),
    ("value_loss", "old_values", torch.randn(B, T + 1), ValueError, "old_values"),
    ("value_loss", "old_values", None, TypeError, "old_values"),
    ("value_loss", "returns", torch.randn(T, B), ValueError, "returns"),
    ("value_loss", "returns", lambda d: d["returns"].to(META), ValueError, "returns"),
    ("value_loss", "response_mask", torch.ones(B), ValueError, "response_mask"),
    ("value_loss", "clip_range", -0.1, ValueError, "clip_range"),
    ("value_loss", "clip_range", math.inf, ValueError, "clip_range"),
    ("value_loss", "loss_agg_mode", "sum", ValueError, "loss_agg_mode"),
]


def _row_id(row):
    fn, arg, val, exc, _ = row
    if callable(val) and not isinstance(val, torch.Tensor):
        desc = "derived"
    elif isinstance(val, torch.Tensor):
        desc = f"{str(val.dtype)[6:]}{list(val.shape)}" + ("meta" if val.is_meta else "")
    else:
        desc = repr(val)[:20]
    return f"{fn}-{arg}-{desc}"


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_bad_input_raises_naming_the_argument(row):
    fn_name, arg, val, exc, match = row
    fn, base = FUNCS[fn_name]
    kwargs = base()
    if callable(val) and not isinstance(val, torch.Tensor):
        val = val(kwargs)
    kwargs[arg] = val
    with pytest.raises(exc, match=match) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert msg.split(":")[0].strip() == match or match in msg
    assert len(msg) > len(match) + 10  # says what was expected / given


def test_every_public_function_has_rows():
    assert {r[0] for r in ROWS} == set(FUNCS)


def test_base_calls_are_valid():
    """The table's base inputs are valid: each row fails because of its one change."""
    for name, (fn, base) in FUNCS.items():
        fn(**base())


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
def test_dual_clip_only_with_a_clipped_surrogate(policy_loss):
    with pytest.raises(ValueError, match="dual_clip_c"):
        pk.ppo_loss(**base_ppo(), policy_loss=policy_loss, dual_clip_c=3.0)


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
def test_inplace_backward_allocates_as_usual_for_sequence_losses(policy_loss):
    """As documented: the two-phase path's gradient sweep writes a fresh buffer."""
    d = base_ppo()
    grads = []
    for inplace in (False, True):
        x = d["logits"].clone().requires_grad_(True)
        pk.ppo_loss(**dict(d, logits=x), policy_loss=policy_loss,
                    inplace_backward=inplace)[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_kl_coef_without_ref_logprobs():
    d = base_ppo()
    d["ref_logprobs"] = None
    d["kl_coef"] = 0.1
    with pytest.raises(ValueError, match="ref_logprobs"):
        pk.ppo_loss(**d)
    d["kl_coef"] = 0.0
    pk.ppo_loss(**d)  # fine without a penalty


@pytest.mark.parametrize("bad", [-1, V, V + 7, -10**9, 2**40])
def test_out_of_range_tokens_on_masked_positions_are_fine(bad):
    for name in ("ppo_loss", "token_logprobs", "score_rollout"):
        fn, base = FUNCS[name]
        d = base()
        d["tokens"] = d["tokens"].clone()
        d["tokens"][1, 2] = bad
        d["response_mask"] = d["response_mask"].clone()
        d["response_mask"][1, 2] = False
        out = fn(**d)
        first = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(first).all(), name
        d["response_mask"][1, 2] = True
        with pytest.raises(ValueError, match="tokens"):
            fn(**d)


def test_int32_tokens_and_mask_dtypes_accepted():
    d = base_ppo()
    loss_ref, _ = pk.ppo_loss(**d)
    d["tokens"] = d["tokens"].int()
    for m in (d["response_mask"].int(), d["response_mask"].float(), None):
        d["response_mask"] = m
        loss, _ = pk.ppo_loss(**d)
        assert float(loss) == pytest.approx(float(loss_ref), rel=1e-6)


@pytest.mark.parametrize("kw", [dict(clip_eps_low=0.0), dict(clip_eps_low=0.999),
                                dict(clip_eps_high=0.0), dict(dual_clip_c=1.2001),
                                dict(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=4.0),
                                dict(global_num_tokens=torch.tensor(7)),
                                dict(global_num_seqs=torch.tensor(5.0)), dict(global_num_seqs=1),
                                dict(temperature=1e-3), dict(temperature=3e-38),
                                dict(grad_scale=1e-30), dict(kl_coef=0.0),
                                dict(global_num_tokens=1), dict(norm_length=0.5)])
def test_range_boundaries_are_accepted(kw):
    loss, _ = pk.ppo_loss(**base_ppo(), **kw)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("gamma,lam", [(0.0, 0.0), (1.0, 1.0), (0, 1)])
def test_gae_boundaries_accepted(gamma, lam):
    adv, _ = pk.gae(**base_gae(), gamma=gamma, lam=lam)
    assert torch.isfinite(adv).all()


def test_value_loss_zero_clip_range_accepted():
    loss, _ = pk.value_loss(**base_vl(), clip_range=0)
    assert torch.isfinite(loss)


@pytest.mark.skipif(HAS_CUDA_DEVICE, reason="with a GPU, triton runs there")
def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    d = base_tlp()
    d["backend"] = "triton"
    with pytest.raises(ValueError, match="backend"):
        pk.token_logprobs(**d)


@pytest.mark.skipif(not HAS_CUDA_DEVICE, reason="needs a CUDA device for a real device mismatch")
def test_device_mismatch_cuda():
    d = base_ppo()
    d["logits"] = d["logits"].cuda()
    d["backend"] = "auto"
    with pytest.raises(ValueError, match="tokens"):
        pk.ppo_loss(**d)
    d["tokens"] = d["tokens"].cuda()
    with pytest.raises(ValueError, match="old_logprobs"):
        pk.ppo_loss(**d)
    g = base_gae()
    with pytest.raises(ValueError, match="values"):
        pk.gae(g["rewards"].cuda(), g["values"], g["response_mask"].cuda())


@pytest.mark.parametrize("name", ["kl_bias_correction", "inplace_backward"])
def test_flags_are_bools(name):
    with pytest.raises(TypeError, match=name):
        pk.ppo_loss(**base_ppo(), **{name: 1})


def test_tokens_one_position_too_long_get_a_hint():
    d = base_ppo()
    d["logits"] = torch.randn(B, T + 1, V)
    d["tokens"] = torch.randint(0, V, (B, T + 1))
    with pytest.raises(ValueError, match=r"tokens\[:, 1:\]"):
        pk.ppo_loss(**d)


def test_rollout_threshold_order_message():
    d = base_ppo()
    with pytest.raises(ValueError, match="hi > lo"):
        pk.ppo_loss(**d, rollout_logprobs=d["old_logprobs"], rollout_correction="mis",
                    rollout_is_threshold=(2.0, 0.5))
