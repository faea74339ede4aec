// The per-token epilogue of the vocabulary-row kernels (row_kernels.cuh): what one thread
// does with a row's merged statistics, i.e. the token's logprob, the per-token outputs and,
// in kModePpo, the loss terms and d loss / d logp, d loss / d H through ppo::token_loss
// (ppo_math.h, the one place of the formulas). Every piece is __host__ __device__, so
// host_check/emulate_rows.cu runs exactly this code on the CPU (fetch_token and
// token_epilogue included) against a long-double formula.
#pragma once

#include <cstdint>

#include "ppo_math.h"
#include "row_reduce.cuh"

namespace ppo_cuda {

template <typename scalar_t>
struct RowsView {
  const scalar_t* logits;
  int64_t sB, sT;  // element strides of logits over B and Tl
  scalar_t* out;   // gradient destination, or nullptr for no gradient
  int64_t oB, oT;  // element strides of out (dlogits contiguous, or logits' own in place)
  const int64_t* tokens;  // [B, T] contiguous
  const bool* mask;       // [B, T] contiguous
  int64_t B, T, Tl, V;
};

enum RowMode : int { kModeLogprobs = 0, kModePpo = 1, kModeScore = 2 };

// Per-token inputs and outputs of the epilogue, [B, T] contiguous, index i = b * T + t.
// A null output pointer is not written.
template <typename A>
struct TokenIO {
  int mode;
  // kModePpo
  const A* old_logp;  // null: on-policy, old = logp (rho = 1, d rho / d logp = 1)
  const A* adv;
  const A* weights;   // loss_agg_mode weights w: d loss / d logp is w * (...)
  const A* w_ent;     // entropy_agg_mode weights: d loss / d H = -w_ent * entropy_coef;
                      // null: weights
  const A* is_w;      // null: 1
  ppo::PolicyParams params;
  A grad_scale;   // dlogp and dent are multiplied by it (1 outside kModePpo)
  // kModePpo (when params.has_ref) and kModeScore
  const A* ref_logp;
  // kModeScore
  A kl_coef;
  int kl_estimator;
  // outputs
  A* logp;
  A* entropy;
  A* row_max;
  A* log_sum;
  A* loss_tok;
  A* kl;
  A* rewards;
};

// What the epilogue reads of one row, fetched by its thread at the START of the row, so
// that the loads are in flight during sweep 1, not after its barriers.
template <typename A>
struct TokenIn {
  int32_t col;  // the token's column (tok_column): -1, out of [0, V), is not read
  A x_tok, old_logp, adv, w, w_ent, ref, isw;
};

template <typename scalar_t, typename A>
PPO_CUDA_HD TokenIn<A> fetch_token(const TokenIO<A>& io, const RowsView<scalar_t>& rv,
                                   const scalar_t* row, int64_t i) {
  TokenIn<A> in{};
  in.col = tok_column(rv.tokens[i], rv.V);
  in.x_tok = in.col >= 0 ? static_cast<A>(row[in.col]) : A(0);
  in.isw = A(1);
  if (io.mode == kModePpo) {
    if (io.old_logp) in.old_logp = io.old_logp[i];
    in.adv = io.adv[i];
    in.w = io.weights[i];
    in.w_ent = io.w_ent ? io.w_ent[i] : in.w;
    if (io.params.has_ref) in.ref = io.ref_logp[i];
    if (io.is_w) in.isw = io.is_w[i];
  } else if (io.mode == kModeScore) {
    in.ref = io.ref_logp[i];
  }
  return in;
}

// Writes the row's per-token outputs and returns what its gradient sweep needs (dlogp and
// dent already times grad_scale: the token epilogue is where the known loss scale enters).
template <typename A>
PPO_CUDA_HD GradRow<A> token_epilogue(const TokenIO<A>& io, int64_t i, const TokenIn<A>& in,
                                      const RowStats<A>& rs, Temp<A> tp) {
  const A logp = in.col >= 0 ? token_logp(in.x_tok, rs.xmax, rs.log_s, tp.inv) : quiet_nan<A>();
  if (io.logp) io.logp[i] = logp;
  if (io.entropy) io.entropy[i] = rs.entropy;
  if (io.row_max) io.row_max[i] = rs.xmax;
  if (io.log_sum) io.log_sum[i] = rs.log_s;
  A dlogp = A(0), dent = A(0);
  if (io.mode == kModePpo) {
    // on-policy: old = logp exactly, so the log-ratio is 0 and rho = 1 (ppo_math.h takes
    // old as a constant, so d rho / d logp = rho = 1: the gradient of exp(logp - sg(logp)))
    const A old = io.old_logp ? in.old_logp : logp;
    const ppo::TokenLoss<A> tl = ppo::token_loss(logp, rs.entropy, old, in.adv, in.ref, in.isw,
                                                 in.w, in.w_ent, io.params);
    io.loss_tok[i] = tl.loss;
    dlogp = tl.dlogp * io.grad_scale;
    dent = tl.dent * io.grad_scale;
  } else if (io.mode == kModeScore) {
    const ppo::KlTerm<A> k = ppo::kl_term(logp - in.ref, io.kl_estimator);
    io.kl[i] = k.kl;
    io.rewards[i] = -io.kl_coef * k.kl;
  }
  GradRow<A> g;
  g.xmax = rs.xmax;
  g.log_s2 = rs.log_s2;
  g.entropy = rs.entropy;
  g.dlogp = dlogp;
  g.dent = dent;
  g.g_tok = token_grad(logp, rs.entropy, dlogp, dent, tp.inv);
  g.tok = in.col;
  return g;
}

template <typename A>
PPO_CUDA_HD void token_epilogue_masked(const TokenIO<A>& io, int64_t i) {
  if (io.logp) io.logp[i] = A(0);
  if (io.entropy) io.entropy[i] = A(0);
  if (io.row_max) io.row_max[i] = A(0);
  if (io.log_sum) io.log_sum[i] = A(0);
  if (io.loss_tok) io.loss_tok[i] = A(0);
  if (io.kl) io.kl[i] = A(0);
  if (io.rewards) io.rewards[i] = A(0);
}

template <typename A>
PPO_CUDA_HD bool grad_is_zero(const GradRow<A>& g) {
  return g.dlogp == A(0) && g.dent == A(0);  // e.g. a clipped token: no need to read again
}

}  // namespace ppo_cuda
