"""ppo_kernels.integrations.trl against the real TRL 1.16 GRPOTrainer (no downloads: a tiny
Llama and a character-level tokenizer built here).

For each supported configuration, the loss, the logged metrics and the parameter gradients
of FusedGRPOTrainer._compute_loss equal the stock GRPOTrainer._compute_loss on the same
batch (float32, rtol 1e-5 / atol 1e-6); real train() runs log the same metrics; every
unsupported option raises ValueError when the trainer is built.
"""

import math
import os
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Every test here builds a trl.GRPOTrainer, and trl imports `datasets` (a hard dependency
# of trl): where either is absent (the H200 image lists neither) the module is skipped as a
# whole at collection, instead of a collection error that stops `pytest tests`.
Dataset = pytest.importorskip("datasets", reason="trl's GRPOTrainer needs datasets").Dataset
pytest.importorskip("trl", reason="the TRL integration tests need trl")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.integrations.trl import (FusedGRPOLossMixin, FusedGRPOTrainer,  # noqa: E402
                                          from_trl_config, fuse_grpo_loss, trl_batch_kwargs)

RTOL, ATOL = 1e-5, 1e-6
GA = 2  # gradient-accumulation steps the normalisers see
B, P, T = 6, 5, 7
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 "


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", padding_side="left")


def tiny_model(seed=0, **config_attrs):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2)
    for k, v in config_attrs.items():  # read by TRL's fused head and by ours
        setattr(cfg, k, v)
    return LlamaForCausalLM(cfg).float()


DATA = Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "count 12", "go", "rl"]})


def reward_len(completions, **kwargs):
    return [len(c) / 8.0 for c in completions]


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4,
                num_generations=4, max_completion_length=T, use_cpu=True, bf16=False,
                seed=0, save_strategy="no", logging_steps=1, gradient_accumulation_steps=GA)
    base.update(kw)
    return GRPOConfig(**base)


def saved_model(tmp_path, **config_attrs):
    """A tiny model saved under tmp_path: TRL loads the policy and (beta > 0) the
    reference model from the path, offline."""
    path = tmp_path / "model"
    tiny_model(**config_attrs).save_pretrained(path)
    return str(path)


def trainer_pair(tmp_path, model_attrs=None, **kw):
    path = saved_model(tmp_path, **(model_attrs or {}))
    args = config(tmp_path, **kw)
    made = []
    for cls in (GRPOTrainer, FusedGRPOTrainer):
        tr = cls(model=path, reward_funcs=reward_len, args=args,
                 train_dataset=DATA, processing_class=tokenizer())
        tr.current_gradient_accumulation_steps = GA
        made.append(tr)
    return made


def batch(stock, *, seed=1, old=True, ref=True, tool=False, vllm=None, adv_2d=False):
    """A micro-batch as TRL's _generate_and_score_completions hands it to _compute_loss:
    left-padded prompts, right-padded completions (one empty), per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 40, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_ids[prompt_mask == 0] = 0
    comp_ids = torch.randint(3, 160, (B, T), generator=g)
    lens = torch.tensor([T, 4, T, 0, 2, 5])
    comp_mask = (torch.arange(T)[None] < lens[:, None]).long()
    comp_ids[comp_mask == 0] = 0
    with torch.no_grad():
        lp, _, _ = stock._get_per_token_logps_and_entropies(
            stock.model, torch.cat([prompt_ids, comp_ids], 1),
            torch.cat([prompt_mask, comp_mask], 1), T)
    valid = comp_mask.bool()
    adv = torch.rand(B, generator=g) * torch.tensor([1.0, -1.0, 0.0, -1.0, 1.0, -1.0])
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
           "completion_mask": comp_mask,
           "advantages": adv[:, None] * torch.rand(B, T, generator=g) if adv_2d else adv,
           "num_items_in_batch": comp_mask.sum() * 2 - 3}
    if old:
        out["old_per_token_logps"] = torch.where(
            valid, lp + 0.3 * torch.randn(B, T, generator=g), 0.0)
    if ref:
        out["ref_per_token_logps"] = torch.where(
            valid, lp + 0.3 * torch.randn(B, T, generator=g), 0.0)
    if tool:
        tm = torch.ones(B, T, dtype=torch.long)
        tm[0, 2:4] = 0
        tm[4, 0] = 0
        out["tool_mask"] = tm
    if vllm is not None:  # TRL's importance_sampling_ratio, [B, T] or [B, 1]
        base = out.get("old_per_token_logps", lp)
        samp = torch.where(valid, base + 0.2 * torch.randn(B, T, generator=g), 0.0)
        samp[0, 1] = float("nan")  # a token vLLM could not score
        diff = torch.nan_to_num((base - samp) * comp_mask, nan=0.0)
        if vllm.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        r = torch.exp(diff)
        r = torch.clamp(r, max=1.5) if vllm.endswith("truncate") else r.masked_fill(r > 1.5, 0)
        out["importance_sampling_ratio"], out["sampling_per_token_logps"] = r, samp
    return out


def run_loss(trainer, inputs, train=True):
    trainer.model.train(train)
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    mode = "train" if train else "eval"
    return loss.detach(), dict(trainer._metrics[mode]), grads


def close(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)


def assert_parity(stock, fused, inputs, train=True):
    ls, ms, gs = run_loss(stock, inputs, train)
    lf, mf, gf = run_loss(fused, inputs, train)
    close(lf, ls)
    assert sorted(mf) == sorted(ms), (sorted(mf), sorted(ms))
    for k in ms:
        assert len(mf[k]) == len(ms[k]), k
        close(mf[k], ms[k])
    assert sorted(gf) == sorted(gs)
    assert any(g.abs().max() > 0 for g in gs.values())
    for n in gs:
        close(gf[n], gs[n])
    return ls, ms


# (GRPOConfig options, batch options, model config attributes)
CASES = {
    "grpo-on-policy": (dict(loss_type="grpo"), dict(old=False), None),
    "grpo": (dict(loss_type="grpo"), {}, None),
    "bnpo": (dict(loss_type="bnpo"), {}, None),
    "dr_grpo": (dict(loss_type="dr_grpo"), {}, None),
    "dapo": (dict(loss_type="dapo", epsilon_high=0.28), {}, None),
    "dapo-on-policy": (dict(loss_type="dapo"), dict(old=False), None),
    "luspo": (dict(loss_type="luspo"), {}, None),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.2), {}, None),
    "sapo": (dict(loss_type="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.3), {},
             None),
    "vespo": (dict(loss_type="vespo"), {}, None),
    "vespo-params-kl": (dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5,
                             vespo_k_neg=4.0, vespo_lambda_neg=5.0, beta=0.1), {}, None),
    "vespo-on-policy-2d": (dict(loss_type="vespo"), dict(old=False, adv_2d=True), None),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05,
                  epsilon_high=0.08), {}, None),
    "gspo-dapo-kl": (dict(loss_type="dapo", importance_sampling_level="sequence",
                          epsilon=0.05, epsilon_high=0.08, beta=0.1), {}, None),
    "beta-bias-corrected": (dict(loss_type="grpo", beta=0.1), {}, None),
    "beta-plain": (dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=False), {}, None),
    "beta-on-policy": (dict(loss_type="dapo", beta=0.1), dict(old=False), None),
    "entropy-grpo": (dict(loss_type="grpo", entropy_coef=0.05), {}, None),
    "entropy-dapo": (dict(loss_type="dapo", entropy_coef=0.05, beta=0.1), {}, None),
    "entropy-adaptive": (dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.02,
                              entropy_target=10.0), {}, None),
    "delta": (dict(loss_type="grpo", epsilon_high=0.28, delta=1.4), {}, None),
    "vllm-token-truncate": (dict(loss_type="dapo"), dict(vllm="token_truncate"), None),
    "vllm-token-mask": (dict(loss_type="grpo"), dict(vllm="token_mask"), None),
    "vllm-seq-mask": (dict(loss_type="dapo", beta=0.1), dict(vllm="sequence_mask"), None),
    "vllm-seq-truncate": (dict(loss_type="bnpo"), dict(vllm="sequence_truncate"), None),
    "off-policy-mask": (dict(loss_type="grpo", off_policy_mask_threshold=0.02), {}, None),
    "off-policy-mask-vllm": (dict(loss_type="dapo", off_policy_mask_threshold=0.02),
                             dict(vllm="token_truncate"), None),
    "off-policy-mask-on-policy": (dict(loss_type="grpo", off_policy_mask_threshold=-0.01),
                                  dict(old=False), None),
    "tool-mask": (dict(loss_type="dapo", beta=0.1), dict(tool=True), None),
    "top-entropy-quantile": (dict(loss_type="grpo", top_entropy_quantile=0.5), {}, None),
    "advantages-2d": (dict(loss_type="bnpo"), dict(adv_2d=True), None),
    "temperature": (dict(loss_type="grpo", temperature=0.7), {}, None),
    "softcap-and-scale": (dict(loss_type="dapo", beta=0.1),
                          {}, dict(final_logit_softcapping=3.0, logit_scale=0.5)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compute_loss_parity(tmp_path, name):
    cfg, bkw, attrs = CASES[name]
    stock, fused = trainer_pair(tmp_path, attrs, **cfg)
    if "vllm" in bkw:
        for tr in (stock, fused):
            tr.use_vllm, tr.vllm_importance_sampling_correction = True, True
    inputs = batch(stock, **bkw)
    loss, metrics = assert_parity(stock, fused, inputs)
    assert torch.isfinite(loss) and "entropy" in metrics
    if cfg.get("beta"):
        assert "kl" in metrics
    if cfg["loss_type"] == "vespo":
        assert "vespo/phi_seq_mean" in metrics
    elif cfg["loss_type"] not in ("cispo", "sapo"):
        assert "clip_ratio/region_mean" in metrics


def test_eval_mode_and_adaptive_state(tmp_path):
    stock, fused = trainer_pair(tmp_path, loss_type="dapo", entropy_coef=0.05)
    assert_parity(stock, fused, batch(stock), train=False)
    stock, fused = trainer_pair(tmp_path, loss_type="grpo", use_adaptive_entropy=True,
                                entropy_coef=0.02, entropy_target=10.0)
    inputs = batch(stock)
    for _ in range(2):  # the controller moves the coefficient on both the same way
        assert_parity(stock, fused, inputs)
        assert fused.entropy_coef == stock.entropy_coef
        assert fused._last_world_entropy == stock._last_world_entropy
    assert stock.entropy_coef != 0.02


def test_clipping_is_exercised(tmp_path):
    """The parity batches are off-policy enough to clip on both sides."""
    stock, fused = trainer_pair(tmp_path, loss_type="grpo")
    _, metrics = assert_parity(stock, fused, batch(stock))
    assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0


def test_one_line_hook(tmp_path):
    stock, _ = trainer_pair(tmp_path, loss_type="dapo", beta=0.1)
    other = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=reward_len,
                        args=stock.args, train_dataset=DATA, processing_class=tokenizer())
    other.current_gradient_accumulation_steps = GA
    assert fuse_grpo_loss(other) is other
    assert "_compute_loss" in vars(other)
    assert_parity(stock, other, batch(stock))


def test_hook_rejects_and_leaves_trainer(tmp_path):
    stock, _ = trainer_pair(tmp_path, loss_type="grpo")
    stock.loss_type = stock.args.loss_type = "not_a_loss"
    with pytest.raises(ValueError, match="loss_type='not_a_loss'"):
        fuse_grpo_loss(stock)
    assert "_compute_loss" not in vars(stock)


def test_from_trl_config_own_loop(tmp_path):
    """from_trl_config + trl_batch_kwargs with ppo_loss_from_hidden by hand give the stock
    trainer's loss (dapo: the token count of the generation batch, entropy bonus)."""
    stock, _ = trainer_pair(tmp_path, loss_type="dapo", beta=0.1, entropy_coef=0.05)
    kw = from_trl_config(stock.args, stock.model.config)
    assert kw["policy_loss"] == "vanilla" and kw["loss_agg_mode"] == "token-mean"
    assert kw["kl_coef"] == 0.1 and kw["kl_bias_correction"] and kw["kl_estimator"] == "k3"
    inputs = batch(stock)
    ls, _, _ = run_loss(stock, inputs)
    mask = inputs["completion_mask"]
    bkw, divisor = trl_batch_kwargs(stock.args, mask,
                                    num_items_in_batch=inputs["num_items_in_batch"],
                                    grad_accum_steps=GA)
    assert divisor == 1
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], mask], 1)
    with torch.no_grad():
        hidden = stock.model.model(input_ids=ids, attention_mask=am).last_hidden_state
        loss, _ = pk.ppo_loss_from_hidden(
            hidden[:, -T - 1:], stock.model.lm_head.weight, inputs["completion_ids"],
            inputs["old_per_token_logps"], inputs["advantages"], mask,
            inputs["ref_per_token_logps"], **{**kw, **bkw})
    close(loss / divisor, ls)


def test_from_trl_config_mapping(tmp_path):
    def kw(**c):
        return from_trl_config(config(tmp_path, **c))
    assert kw(loss_type="grpo")["loss_agg_mode"] == "seq-mean-token-mean"
    assert kw(loss_type="dr_grpo")["norm_length"] == T
    assert kw(loss_type="luspo")["loss_agg_mode"] == "seq-mean-token-sum"
    c = kw(loss_type="cispo", epsilon_high=5.0)
    assert (c["policy_loss"], c["clip_eps_low"], c["clip_eps_high"]) == ("cispo", 1.0, 4.0)
    g = kw(loss_type="grpo", importance_sampling_level="sequence", delta=2.0)
    assert (g["policy_loss"], g["dual_clip_c"]) == ("gspo", 2.0)
    s = kw(loss_type="sapo", sapo_temperature_pos=0.5)
    assert (s["policy_loss"], s["sapo_tau_pos"]) == ("sapo", 0.5)
    assert kw(loss_type="grpo", off_policy_mask_threshold=0.5)["off_policy_mask_threshold"] \
        == 0.5
    assert from_trl_config(config(tmp_path), tiny_model(final_logit_softcapping=30.0).config)[
        "logit_softcap"] == 30.0


UNSUPPORTED = {
    "cispo-sequence": (dict(loss_type="cispo", epsilon_high=5.0,
                            importance_sampling_level="sequence"),
                       "importance_sampling_level='sequence'"),
    "sapo-sequence": (dict(loss_type="sapo", importance_sampling_level="sequence"),
                      "importance_sampling_level='sequence'"),
    "cispo-cap-below-1": (dict(loss_type="cispo"), "epsilon_high=None"),
    "delta-in-band": (dict(loss_type="grpo", delta=1.1), "delta=1.1"),
    "epsilon-high-1": (dict(loss_type="dapo", epsilon_high=1.5), "epsilon_high=1.5"),
    "quantile-with-bonus": (dict(loss_type="grpo", top_entropy_quantile=0.2,
                                 entropy_coef=0.01), "top_entropy_quantile=0.2"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_options_raise(tmp_path, name):
    cfg, match = UNSUPPORTED[name]
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        FusedGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, args=config(tmp_path, **cfg),
                         train_dataset=DATA, processing_class=tokenizer())
    if True:  # the stock trainer accepts them: they are ours to reject
        GRPOTrainer(model=tiny_model(), reward_funcs=reward_len, args=config(tmp_path, **cfg),
                    train_dataset=DATA, processing_class=tokenizer())


def test_vespo_mapping_and_vllm_refusal(tmp_path):
    """loss_type="vespo" maps to policy_loss="vespo" with TRL's k / lambda (TRL clamps the
    lambdas at 1e-4); TRL's VESPO folds the vLLM importance ratios into its sequence
    weight, which the op does not: that combination is refused by name."""
    kw = from_trl_config(config(tmp_path, loss_type="vespo", vespo_k_pos=1.5,
                                vespo_lambda_neg=0.0))
    assert (kw["policy_loss"], kw["vespo_k_pos"], kw["vespo_lambda_neg"],
            kw["loss_agg_mode"]) == ("vespo", 1.5, 1e-4, "token-mean")
    cfg = config(tmp_path, loss_type="vespo")
    cfg.use_vllm, cfg.vllm_importance_sampling_correction = True, True
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):
        from_trl_config(cfg)


def test_vespo_against_trl_gamma_weights():
    """The op's vespo against TRL's own GRPOTrainer.get_gamma_weights on the same inputs
    (per-sequence and per-token advantages, padding, log-ratios beyond the clamps): the
    per-token loss -phi A logp (TRL's _compute_loss) and its gradient in the logits."""
    g = torch.Generator().manual_seed(3)
    b, t, v = 4, 6, 11
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    tok = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[2] = False
    lp0 = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    old = lp0 + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    old[3, 1] -= 30.0  # beyond the +-20 token clamp and the log 1e-8 sequence clamp
    for adv in (torch.randn(b, 1, generator=g, dtype=torch.float64),
                torch.randn(b, t, generator=g, dtype=torch.float64)):
        opts = dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.0, lambda_neg=1.0)
        x = logits.clone().requires_grad_(True)
        lp = torch.log_softmax(x, -1).gather(-1, tok[..., None])[..., 0]
        phi = GRPOTrainer.get_gamma_weights(adv, lp.detach() - old, mask.double(), None,
                                            **opts)
        per_tok = -phi * adv * lp
        want = (per_tok * mask).sum()
        want.backward()
        for backend in ("cpu", "torch"):
            y = logits.clone().requires_grad_(True)
            loss, _ = pk.ppo_loss(y, tok, old, adv, mask, policy_loss="vespo",
                                  loss_agg_mode="token-sum", backend=backend,
                                  **{f"vespo_{k}": val for k, val in opts.items()})
            loss.backward()
            assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
            torch.testing.assert_close(y.grad, x.grad, rtol=1e-10, atol=1e-14)


def test_off_policy_mask_against_trl_per_sequence_advantages():
    """With per-sequence advantages the op's off-policy mask is TRL's get_off_policy_mask
    (DeepSeek-V3.2); with per-token advantages TRL decides per token, the op per sequence
    by the mean advantage (docs/LOSSES.md)."""
    g = torch.Generator().manual_seed(4)
    b, t, v = 6, 5, 9
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    tok = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    lp = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    old = lp + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    samp = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64)
    keep = GRPOTrainer.get_off_policy_mask(adv, lp, samp, mask.double(), 0.05)
    ratio = torch.exp(lp - old)
    per_tok = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * keep
    want = (per_tok * mask).sum()
    loss, met = pk.ppo_loss(logits, tok, old, adv, mask, rollout_logprobs=samp,
                            off_policy_mask_threshold=0.05, loss_agg_mode="token-sum",
                            backend="cpu")
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    nonempty = mask.any(-1)
    assert float(met["off_policy_masked_frac"]) == pytest.approx(
        float(((keep[:, 0] == 0) & nonempty).sum() / nonempty.sum()), rel=1e-6)


def test_moe_aux_loss_raises(tmp_path):
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        FusedGRPOTrainer(model=tiny_model(output_router_logits=False), reward_funcs=reward_len,
                         args=config(tmp_path, router_aux_loss_coef=0.01), train_dataset=DATA,
                         processing_class=tokenizer())


TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second",
               "train_steps_per_second")


def train_logs(tmp_path, cls, **kw):
    # SGD: a parameter's drift is that of its gradients (Adam's first steps are sign-like)
    args = config(tmp_path, max_steps=3, learning_rate=0.5, optim="sgd", **kw)
    tr = cls(model=tiny_model(), reward_funcs=reward_len, args=args, train_dataset=DATA,
             processing_class=tokenizer())
    tr.train()
    params = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    return [{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in tr.state.log_history], \
        params


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo", num_iterations=2, entropy_coef=0.01),
                                 dict(loss_type="grpo", gradient_accumulation_steps=1)],
                         ids=["dapo-mu2-GA2", "grpo-GA1"])
def test_train_steps_match(tmp_path, cfg):
    stock, ps = train_logs(tmp_path, GRPOTrainer, **cfg)
    fused, pf = train_logs(tmp_path, FusedGRPOTrainer, **cfg)
    assert len(stock) == len(fused) == 4  # 3 steps + the summary
    for es, ef in zip(stock, fused):
        assert sorted(es) == sorted(ef)
        for k in es:
            if isinstance(es[k], float) and math.isnan(es[k]):
                assert math.isnan(ef[k]), k
            else:
                assert ef[k] == pytest.approx(es[k], rel=1e-4, abs=1e-6), k
    assert "entropy" in stock[0] and "reward" in stock[0]
    torch.testing.assert_close(pf, ps, rtol=1e-4, atol=1e-6)


def test_on_policy_logp_minus_ref_and_old_is_zero(tmp_path):
    """The fused trainer computes the old and reference log-probs with the kernel of its
    loss: on-policy (the policy is the reference, and the old log-probs are its own), the
    KL and every ratio are exactly 0 and 1, as in stock TRL (where rounding noise would be
    amplified by AdamW on zero-gradient coordinates)."""
    _, fused = trainer_pair(tmp_path, beta=0.04)
    inputs = batch(fused, old=False, ref=False)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        ref, _, _ = fused._get_per_token_logps_and_entropies(fused.ref_model, ids, att, T,
                                                            batch_size=2)
        old, _, _ = fused._get_per_token_logps_and_entropies(fused.model, ids, att, T,
                                                            batch_size=2)
    inputs["ref_per_token_logps"], inputs["old_per_token_logps"] = ref, old
    run_loss(fused, inputs)
    m = fused._metrics["train"]
    assert m["kl"][-1] == 0.0
    assert m["clip_ratio/region_mean"][-1] == 0.0


def test_subclass_overrides_are_refused(tmp_path):
    """A subclass's own _compute_loss (which the fused one would shadow) or its own
    _get_per_token_logps_and_entropies is a clear error under fuse_grpo_loss and behind
    the mixin, and the trainer is left as it was; an override in front of the mixin that
    calls super() is honoured."""
    path, args = saved_model(tmp_path), config(tmp_path)

    class Regularised(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs) + 0.0

    class OwnLogps(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *a, **k):
            return super()._get_per_token_logps_and_entropies(*a, **k)

    def make(cls):
        return cls(model=path, reward_funcs=reward_len, args=args, train_dataset=DATA,
                   processing_class=tokenizer())

    for cls, name in ((Regularised, "_compute_loss"),
                      (OwnLogps, "_get_per_token_logps_and_entropies")):
        tr = make(cls)
        with pytest.raises(ValueError, match=name):
            fuse_grpo_loss(tr)
        assert "_compute_loss" not in vars(tr) and not hasattr(tr, "_pk_kwargs")

        class Behind(FusedGRPOLossMixin, cls):
            pass

        with pytest.raises(ValueError, match=name):
            make(Behind)._ppo_kernels_setup()

    class Front(FusedGRPOLossMixin, GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs) * 1.0

    tr = make(Front)
    tr._ppo_kernels_setup()  # the control: no error
    tr.current_gradient_accumulation_steps = GA
    assert torch.isfinite(tr._compute_loss(tr.model, batch(tr)))


def test_trains_under_accelerate_ddp(tmp_path):
    """2 processes, accelerate's DDP on CPU (gloo; tests/trl_ddp_cases.py): with gradient
    checkpointing off, transformers sets find_unused_parameters=True, where a head used
    after the model's forward fails ("Expected to mark a variable ready only once"); the
    fused loss runs inside the model's forward, so both settings train, and the logs and
    parameters after 2 SGD steps equal stock TRL's on every rank."""
    from helpers.ranks import run_ranks
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_ddp_cases.py")
    ranks = run_ranks(script, tmp_path, timeout=480)
    for rank, res in enumerate(ranks):
        for gc in (False, True):
            case = res[f"gc={gc}"]
            for name in ("stock", "fused"):
                assert isinstance(case[name], dict), f"rank {rank} gc={gc} {name}: " \
                                                     f"{case[name]}"
            stock, fused = case["stock"], case["fused"]
            assert fused["ddp"] and fused["processes"] == 2
            assert fused["find_unused"] == (not gc)  # transformers' choice, both exercised
            assert len(stock["logs"]) == len(fused["logs"]) == 3  # 2 steps + the summary
            for es, ef in zip(stock["logs"], fused["logs"]):
                assert sorted(es) == sorted(ef)
                for k in es:
                    if isinstance(es[k], float) and math.isnan(es[k]):
                        assert math.isnan(ef[k]), k
                    else:
                        assert ef[k] == pytest.approx(es[k], rel=1e-4, abs=1e-6), (gc, k)
            torch.testing.assert_close(torch.tensor(fused["params"]),
                                       torch.tensor(stock["params"]), rtol=1e-4, atol=1e-6)
    # DDP keeps the ranks' parameters equal
    assert ranks[0]["gc=False"]["fused"]["params"] == ranks[1]["gc=False"]["fused"]["params"]


@pytest.mark.parametrize("head_dtype", ["float32", "autocast"])
def test_head_dtype_under_bf16_autocast(tmp_path, monkeypatch, head_dtype):
    """GRPOConfig(bf16=True): the fused head runs in float32 by default (as with
    cast_lm_head_to_fp32=True), in autocast's bfloat16 with head_dtype="autocast"; the
    loss stays within bf16 rounding of stock TRL's."""
    import ppo_kernels.integrations.trl as pk_trl
    seen = []
    real = pk_trl.ppo_loss_from_hidden

    def spy(hidden, w, *a, **k):
        seen.append((hidden.dtype, w.dtype, torch.is_autocast_enabled("cpu")))
        return real(hidden, w, *a, **k)
    monkeypatch.setattr(pk_trl, "ppo_loss_from_hidden", spy)
    path = saved_model(tmp_path)
    args = config(tmp_path, bf16=True, loss_type="dapo")
    stock = GRPOTrainer(model=path, reward_funcs=reward_len, args=args, train_dataset=DATA,
                        processing_class=tokenizer())
    fused = FusedGRPOTrainer(model=path, reward_funcs=reward_len, args=args,
                             train_dataset=DATA, processing_class=tokenizer(),
                             head_dtype=head_dtype)
    for tr in (stock, fused):
        tr.current_gradient_accumulation_steps = GA
    inputs = batch(stock)
    ls, _, _ = run_loss(stock, inputs)
    lf, _, _ = run_loss(fused, inputs)
    want = torch.float32 if head_dtype == "float32" else torch.bfloat16
    assert seen == [(want, want, False)]  # the op itself runs outside autocast
    torch.testing.assert_close(lf.float(), ls.float(), rtol=2e-2, atol=2e-3)


def test_head_dtype_rejects(tmp_path):
    path = saved_model(tmp_path)
    for kw, args in ((dict(head_dtype="bf16"), config(tmp_path)),
                     (dict(head_dtype="autocast"), config(tmp_path,
                                                          cast_lm_head_to_fp32=True))):
        with pytest.raises(ValueError, match="head_dtype"):
            FusedGRPOTrainer(model=path, reward_funcs=reward_len, args=args,
                             train_dataset=DATA, processing_class=tokenizer(), **kw)


# ---- sampling replay (sampling_replay=True): GRPOConfig's top_k / top_p / min_p ----------

def replay_trainers(tmp_path, **kw):
    """(fused without replay, fused with replay) on the same saved model and config."""
    path = saved_model(tmp_path)
    args = config(tmp_path, **kw)
    made = []
    for replay in (False, True):
        tr = FusedGRPOTrainer(model=path, reward_funcs=reward_len, args=args,
                              train_dataset=DATA, processing_class=tokenizer(),
                              sampling_replay=replay)
        tr.current_gradient_accumulation_steps = GA
        made.append(tr)
    return made


def manual_replay_loss(trainer, inputs, **replay):
    """pk.ppo_loss on the policy's [B, T, V] logits with the plain config keywords, the
    batch keywords and the given top_k / top_p / min_p; the parameter gradients."""
    model = trainer.model
    model.train(True)
    model.zero_grad(set_to_none=True)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=att).logits[:, -T - 1:-1]
    mask = inputs["completion_mask"]
    kw = from_trl_config(trainer.args, model.config)  # no replay keys
    assert not {"top_k", "top_p", "min_p", "kl_logprobs"} & set(kw)
    bkw, divisor = trl_batch_kwargs(trainer.args, mask,
                                    num_items_in_batch=inputs["num_items_in_batch"],
                                    grad_accum_steps=GA)
    extra = {}
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        extra["rollout_is_weights"] = inputs["importance_sampling_ratio"]
    if "off_policy_mask_threshold" in kw:  # vLLM's log-probs, else the old; NaN: current
        cur = pk.token_logprobs(logits.detach(), inputs["completion_ids"],
                                temperature=trainer.temperature, backend="torch", **replay)
        samp = inputs.get("sampling_per_token_logps", inputs.get("old_per_token_logps"))
        extra["rollout_logprobs"] = cur if samp is None else torch.where(
            torch.isnan(samp), cur, samp)
    if trainer.beta != 0.0:
        replay["kl_logprobs"] = "kept"
    loss, _ = pk.ppo_loss(logits, inputs["completion_ids"], inputs.get("old_per_token_logps"),
                          inputs["advantages"], mask, inputs.get("ref_per_token_logps"),
                          backend="torch", **{**kw, **bkw, **replay, **extra})
    loss = loss / divisor
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads


REPLAY_CASES = {
    "top_k-top_p-kl": (dict(loss_type="grpo", beta=0.04, top_k=20, top_p=0.9,
                            temperature=0.7), dict(top_k=20, top_p=0.9)),
    "min_p-dapo": (dict(loss_type="dapo", min_p=0.8, temperature=0.5), dict(min_p=0.8)),
    "top_k-cispo": (dict(loss_type="cispo", epsilon_high=1.2, top_k=8), dict(top_k=8)),
    "top_p-gspo": (dict(loss_type="grpo", importance_sampling_level="sequence", top_p=0.8,
                        epsilon=0.05, epsilon_high=0.08), dict(top_p=0.8)),
    "off-policy-mask-top_k": (dict(loss_type="grpo", off_policy_mask_threshold=0.02,
                                   top_k=16), dict(top_k=16)),
    "vllm-is-top_p": (dict(loss_type="dapo", top_p=0.9, beta=0.1), dict(top_p=0.9)),
    "vllm-off-policy-mask": (dict(loss_type="grpo", off_policy_mask_threshold=0.02,
                                  top_k=30, temperature=0.9), dict(top_k=30)),
}
REPLAY_VLLM = ("vllm-is-top_p", "vllm-off-policy-mask")


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_sampling_replay_loss_equals_ppo_loss(tmp_path, name):
    """With sampling_replay=True the fused loss and its parameter gradients equal pk.ppo_loss
    on the same batch with the same top_k / top_p / min_p (and temperature); without it the
    fused trainer's loss is another (the full-vocabulary one)."""
    cfg, replay = REPLAY_CASES[name]
    plain, fused = replay_trainers(tmp_path, **cfg)
    if name in REPLAY_VLLM:  # TRL's importance_sampling_ratio and vLLM's log-probs
        for tr in (plain, fused):
            tr.use_vllm, tr.vllm_importance_sampling_correction = True, True
    inputs = batch(fused, vllm="token_truncate" if name in REPLAY_VLLM else None)
    lf, mf, gf = run_loss(fused, inputs)
    lm, gm = manual_replay_loss(fused, inputs, **replay)
    close(lf, lm)
    assert sorted(gf) == sorted(gm)
    for n in gm:
        close(gf[n], gm[n])
    lp, _, _ = run_loss(plain, inputs)
    assert not torch.allclose(lp, lf, rtol=1e-4, atol=1e-5), (lp, lf)
    assert torch.isfinite(lf) and "entropy" in mf


def test_sampling_replay_old_and_ref_logprobs(tmp_path):
    """The old / reference log-probs the fused trainer computes with sampling_replay are
    pk.token_logprobs over the kept sets (each model's own logits, the generation
    temperature); on-policy the KL is 0 and no ratio is clipped, and the log-probs are
    those of a kept-set renormalised softmax (>= the full ones)."""
    plain, fused = replay_trainers(tmp_path, beta=0.04, top_k=12, top_p=0.85,
                                   temperature=0.8)
    inputs = batch(fused, old=False, ref=False)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        ref, _, _ = fused._get_per_token_logps_and_entropies(fused.ref_model, ids, att, T,
                                                            batch_size=2)
        old, ent, _ = fused._get_per_token_logps_and_entropies(fused.model, ids, att, T,
                                                              batch_size=2,
                                                              compute_entropy=True)
        full, ent_full, _ = plain._get_per_token_logps_and_entropies(
            plain.model, ids, att, T, batch_size=2, compute_entropy=True)
        for model, got in ((fused.model, old), (fused.ref_model, ref)):
            logits = model(input_ids=ids, attention_mask=att).logits[:, -T - 1:-1]
            want = pk.token_logprobs(logits, inputs["completion_ids"], temperature=0.8,
                                     top_k=12, top_p=0.85, backend="torch")
            close(got, want)
    assert (old >= full - 1e-6).all() and (old > full + 1e-4).any()
    close(ent, ent_full)  # the entropy stays over the full vocabulary
    inputs["ref_per_token_logps"], inputs["old_per_token_logps"] = ref, old
    run_loss(fused, inputs)
    m = fused._metrics["train"]
    assert m["kl"][-1] == 0.0
    assert m["clip_ratio/region_mean"][-1] == 0.0


def test_sampling_replay_off_is_unchanged(tmp_path):
    """sampling_replay=False (the default) with top_k / top_p set: the keywords and the
    results are those of today (parity with stock TRL, which scores the full vocabulary);
    sampling_replay=True with every parameter off is the plain loss bit for bit."""
    stock, fused = trainer_pair(tmp_path, loss_type="grpo", beta=0.1, top_k=10, top_p=0.9)
    kw = from_trl_config(stock.args)
    assert kw == from_trl_config(stock.args, sampling_replay=False)
    assert not {"top_k", "top_p", "min_p", "kl_logprobs"} & set(kw)
    assert_parity(stock, fused, batch(stock))
    plain, replay = replay_trainers(tmp_path / "off", loss_type="dapo", beta=0.1)
    assert from_trl_config(replay.args, sampling_replay=True) == from_trl_config(replay.args)
    inputs = batch(plain)
    lp, mp, gp = run_loss(plain, inputs)
    lr, mr, gr = run_loss(replay, inputs)
    assert torch.equal(lp, lr) and mp == mr
    assert all(torch.equal(gp[n], gr[n]) for n in gp)


def test_sampling_replay_mapping(tmp_path):
    """GRPOConfig -> op keywords: TRL's top_k = 0 and top_p = 1 are off, min_p None off;
    a KL term adds kl_logprobs='kept'."""
    args = config(tmp_path, top_k=0, top_p=0.7, min_p=None, beta=0.0)
    kw = from_trl_config(args, sampling_replay=True)
    assert kw["top_p"] == 0.7 and "top_k" not in kw and "min_p" not in kw
    assert "kl_logprobs" not in kw
    args = config(tmp_path, top_k=50, min_p=0.1, beta=0.2)
    kw = from_trl_config(args, sampling_replay=True)
    assert (kw["top_k"], kw["min_p"], kw["kl_logprobs"]) == (50, 0.1, "kept")
    assert "top_p" not in kw


REPLAY_BAD = {
    "repetition_penalty": (dict(top_k=5, repetition_penalty=1.1), "repetition_penalty=1.1"),
    "generation_kwargs": (dict(top_k=5, generation_kwargs={"top_k": 3}),
                          r"generation_kwargs\['top_k'\]"),
    "generation_kwargs-penalty": (dict(generation_kwargs={"presence_penalty": 0.5}),
                                  r"generation_kwargs\['presence_penalty'\]"),
    "min_p-and-top_p-transformers": (dict(min_p=0.1, top_p=0.9), "min_p=0.1"),
    "top_p-out-of-range": (dict(top_p=0.0), "top_p"),
}


@pytest.mark.parametrize("name", list(REPLAY_BAD))
def test_sampling_replay_bad_combinations_raise(tmp_path, name):
    cfg, match = REPLAY_BAD[name]
    args = config(tmp_path, **cfg)  # GRPOConfig accepts each of them
    with pytest.raises(ValueError, match=match):
        FusedGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, args=args,
                         train_dataset=DATA, processing_class=tokenizer(),
                         sampling_replay=True)
    # without replay the same configuration is accepted (the option is what it concerns)
    FusedGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, args=args,
                     train_dataset=DATA, processing_class=tokenizer())


def test_sampling_replay_type_and_hook(tmp_path):
    args = config(tmp_path, top_k=5)
    with pytest.raises(TypeError, match="sampling_replay"):
        FusedGRPOTrainer(model=tiny_model(), reward_funcs=reward_len, args=args,
                         train_dataset=DATA, processing_class=tokenizer(),
                         sampling_replay="yes")
    with pytest.raises(TypeError, match="sampling_replay"):
        from_trl_config(args, sampling_replay=1)
    bad = GRPOTrainer(model=tiny_model(), reward_funcs=reward_len,
                      args=config(tmp_path, top_k=5, repetition_penalty=1.2),
                      train_dataset=DATA, processing_class=tokenizer())
    with pytest.raises(ValueError, match="repetition_penalty"):
        fuse_grpo_loss(bad, sampling_replay=True)
    assert "_compute_loss" not in vars(bad)
    stock = GRPOTrainer(model=saved_model(tmp_path), reward_funcs=reward_len, args=args,
                        train_dataset=DATA, processing_class=tokenizer())
    stock.current_gradient_accumulation_steps = GA
    fuse_grpo_loss(stock, sampling_replay=True)
    assert stock._pk_replay == {"top_k": 5} and stock._pk_kwargs["top_k"] == 5
    inputs = batch(stock)
    lf, _, gf = run_loss(stock, inputs)
    lm, gm = manual_replay_loss(stock, inputs, top_k=5)
    close(lf, lm)
    for n in gm:
        close(gf[n], gm[n])
