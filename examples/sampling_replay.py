"""Sampling replay: why the ratio against an inference engine's log-probs needs the kept set.

An engine such as vLLM samples from a truncated distribution (here top_k=64, top_p=0.8 after
temperature 1.0) and reports log-probs renormalised over the tokens it kept (vLLM's
logprobs_mode="processed_logprobs"; --return-sampling-mask gives the kept set of every token
as CSR ids + offsets). Scoring the same tokens over the full vocabulary with the SAME
weights gives ratios pi_train / pi_engine = kept mass < 1, not 1: every PPO ratio carries
that bias. With the kept set (given, or re-derived from top_k / top_p) the ratio is 1.

Run:  python examples/sampling_replay.py    (CPU, a few seconds; prints the fractions)
"""

import torch

import ppo_kernels as pk


def engine_step(logits, top_k, top_p, gen):
    """A stand-in for the engine: sample from the truncated distribution, return the tokens,
    the processed log-probs and the kept sets as a SamplingMask (what
    --return-sampling-mask hands back)."""
    B, T, V = logits.shape
    z = logits.reshape(B * T, V)
    srt, idx = z.sort(-1, descending=True)
    kth = srt[:, top_k - 1:top_k]
    keep = z >= kth
    p = torch.where(keep, z, -torch.inf).softmax(-1)
    ps, pidx = p.sort(-1, descending=True)
    above = ps.cumsum(-1) - ps
    keep_sorted = above < top_p
    keep = torch.zeros_like(keep).scatter(-1, pidx, keep_sorted) & keep
    probs = torch.where(keep, z, -torch.inf).softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=gen).view(B, T)
    logp_engine = torch.where(keep, z, -torch.inf).log_softmax(-1).gather(
        -1, tokens.view(-1, 1)).view(B, T)
    ids = keep.nonzero()[:, 1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(-1).cumsum(0)])
    return tokens, logp_engine, pk.SamplingMask(ids, offsets)


def outside(ratio, lo=0.9, hi=1.1):
    return float(((ratio < lo) | (ratio > hi)).float().mean())


def main(B=8, T=64, V=4096, top_k=64, top_p=0.8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * 3.0  # the policy, same weights everywhere
    tokens, engine_logp, mask = engine_step(logits, top_k, top_p, gen)
    adv = torch.randn(B, T, generator=gen)

    plain = pk.token_logprobs(logits, tokens)
    given = pk.token_logprobs(logits, tokens, sampling_mask=mask)
    rederived = pk.token_logprobs(logits, tokens, top_k=top_k, top_p=top_p)
    results = {
        "no replay": outside(torch.exp(plain - engine_logp)),
        "replay, given mask": outside(torch.exp(given - engine_logp)),
        "replay, top_k/top_p": outside(torch.exp(rederived - engine_logp)),
    }
    _, m_plain = pk.ppo_loss(logits, tokens, engine_logp, adv)
    _, m_replay = pk.ppo_loss(logits, tokens, engine_logp, adv, sampling_mask=mask)
    print(f"top_k={top_k}, top_p={top_p}, V={V}, {B * T} tokens")
    for name, frac in results.items():
        print(f"  ratios outside [0.9, 1.1], {name:22s}: {100 * frac:5.1f}%")
    print(f"  ppo_loss ratio_mean: {float(m_plain['ratio_mean']):.4f} without replay, "
          f"{float(m_replay['ratio_mean']):.4f} with; kept_mass "
          f"{float(m_replay['kept_mass']):.3f}, kept_size_mean "
          f"{float(m_replay['kept_size_mean']):.1f}")
    return results, m_plain, m_replay


if __name__ == "__main__":
    main()
