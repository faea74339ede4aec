// Top-k distillation loss on the CPU (ppo_kernels.distill_loss): per position i the forward
// KL from the teacher's distribution on a set S_i of vocabulary ids (CSR: offsets, token_ids,
// teacher_logprobs) to the student's softmax, optionally with the tail bucket, and its
// gradient with respect to the logits written in the same pass (docs/LOSSES.md):
//   kl_i = sum_{j in S} pT_j (lT_j - log pS_j) + [tail] (1 - PT) (log(1 - PT) - log(1 - PS))
//   d kl_i / d z_v = alpha pS_v + [v in S] (beta pS_v - pT_v),
//     tail: alpha = 1 - r, beta = r, r = (1 - PT) / (1 - PS);  no tail: alpha = PT, beta = 0
// with z = logits / temperature. Per row: the row statistics (row_kernels.h: the max and
// log_sum = log1p of the non-top mass), one sweep that keeps p_v in a per-thread scratch
// row, the set's entries gathered from that scratch and zeroed there, so the student's
// complement mass 1 - PS is the sum of what is left (no cancellation when PS -> 1), and the
// gradient sweep from the scratch. The teacher's tail log(1 - PT) is log1p(-PT).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

template <typename T>
struct DistillRow {
  T kl, student_mass, teacher_tail, alpha, beta;
};

// The per-row scalars from the gathered set: log pS_j (exact digits), pS_j (from the
// scratch), the teacher's log-probs, the student's complement mass.
template <typename T>
DistillRow<T> distill_scalars(const T* lps, const T* pss, const T* lt, int64_t k, T comp,
                              bool whole, bool tail) {
  T kl = T(0), pt_sum = T(0), ps_sum = T(0);
  for (int64_t a = 0; a < k; ++a) {
    ps_sum += pss[a];
    const T pt = ppo::ppo_exp(lt[a]);
    pt_sum += pt;
    if (pt > T(0)) kl += pt * (lt[a] - lps[a]);
  }
  // the teacher's tail: 0 for a set holding the whole vocabulary (its missing mass can only
  // be rounding) or one whose mass reaches 1
  T tail_t = whole ? T(0) : T(1) - pt_sum;
  if (!(tail_t > T(0))) tail_t = T(0);
  T alpha = pt_sum, beta = T(0);
  if (tail) {
    T r = T(0);
    if (tail_t > T(0)) {
      const T log_tt = ppo::ppo_log1p(-pt_sum);
      // relative to the scratch's own total (1 up to rounding): an empty set gives exactly
      // log 1 = 0
      const T log_cs = std::log(comp) - std::log(comp + ps_sum);
      kl += tail_t * (log_tt - log_cs);
      r = ppo::ppo_exp(log_tt - log_cs);
    }
    alpha = T(1) - r;
    beta = r;
  }
  return {kl, ps_sum, tail_t, alpha, beta};
}

template <typename scalar_t>
void distill_rows(const at::Tensor& logits, const RowArgs& r, const bool* m, const int64_t* off,
                  const int64_t* ids, const acc_of<scalar_t>* lt, const acc_of<scalar_t>* w,
                  double temperature, double grad_scale, bool tail, scalar_t* out, int64_t oB,
                  int64_t oT, acc_of<scalar_t>* kl, acc_of<scalar_t>* ps,
                  acc_of<scalar_t>* tt) {
  using T = acc_of<scalar_t>;
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const scalar_t* L = logits.data_ptr<scalar_t>();
  const T inv = T(1.0 / temperature);
  const T gs = T(grad_scale);
  at::parallel_for(0, r.B * r.T, row_grain(r.V), [&](int64_t begin, int64_t end) {
    RowWorker<scalar_t> rw(r.V, false);
    std::vector<T> p(r.V);
    std::vector<T> lps, pss;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / r.T, t = i % r.T;
      scalar_t* orow = out ? out + b * oB + t * oT : nullptr;
      if (!m[i]) {
        kl[i] = ps[i] = tt[i] = T(0);
        if (orow) zero_row(orow, r.V);
        continue;
      }
      const scalar_t* x = L + r.offset(i);
      const RowStats<T> st = rw.template stats<false>(x, inv);
      // p_v = exp((x_v - max) / temperature - log_sum) into the scratch row
      const Vec vinv(inv), vmax(st.max), vls(st.log_sum);
      int64_t v = 0;
      if constexpr (!kWiden<scalar_t>) {
        for (; v + W <= r.V; v += W)
          vexp((Vec::loadu(x + v) - vmax) * vinv - vls).store(p.data() + v);
      } else {  // bf16 / fp16: widened in registers, two float vectors per load
        for (; v + 2 * W <= r.V; v += 2 * W) {
          auto [a, c] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(x + v));
          vexp((a - vmax) * vinv - vls).store(p.data() + v);
          vexp((c - vmax) * vinv - vls).store(p.data() + v + W);
        }
      }
      for (; v < r.V; ++v)
        p[v] = ppo::ppo_exp((static_cast<T>(x[v]) - st.max) * inv - st.log_sum);
      const int64_t o0 = off[i], k = off[i + 1] - o0;
      lps.resize(k);
      pss.resize(k);
      for (int64_t a = 0; a < k; ++a) {
        const int64_t id = ids[o0 + a];
        lps[a] = RowWorker<scalar_t>::logp(x, id, inv, st);
        pss[a] = p[id];
      }
      for (int64_t a = 0; a < k; ++a) p[ids[o0 + a]] = T(0);
      // the complement mass: what is left of the scratch (ids are distinct), no cancellation
      Vec acc(T(0));
      v = 0;
      for (; v + W <= r.V; v += W) acc = acc + Vec::loadu(p.data() + v);
      T comp = hsum(acc);
      for (; v < r.V; ++v) comp += p[v];
      const bool whole = k == r.V;
      const DistillRow<T> d = distill_scalars<T>(lps.data(), pss.data(), lt + o0, k, comp, whole, tail);
      kl[i] = d.kl;
      ps[i] = d.student_mass;
      tt[i] = d.teacher_tail;
      if (orow) {
        const T c = w[i] * gs * inv;
        if (c == T(0)) {
          zero_row(orow, r.V);
          continue;
        }
        // the dense part alpha pS_v (the set's entries were zeroed in the scratch and are
        // written from their own formula below)
        const T ca = c * d.alpha;
        for (v = 0; v < r.V; ++v) orow[v] = static_cast<scalar_t>(ca * p[v]);
        for (int64_t a = 0; a < k; ++a) {
          const T pt = ppo::ppo_exp(lt[o0 + a]);
          // tail: pS - pT directly (alpha + beta = 1)
          const T g = tail ? pss[a] - pt : d.alpha * pss[a] - pt;
          orow[ids[o0 + a]] = static_cast<scalar_t>(c * g);
        }
      }
    }
  });
  if (out) {  // positions t >= T of [B, T + 1, V] logits get a zero gradient
    for (int64_t b = 0; b < r.B; ++b)
      for (int64_t t = r.T; t < r.Tl; ++t) zero_row(out + b * oB + t * oT, r.V);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distill_fwd(
    const at::Tensor& logits, const at::Tensor& mask_in, const at::Tensor& offsets_in,
    const at::Tensor& ids_in, const at::Tensor& lt_in, const at::Tensor& weights_in,
    double temperature, double grad_scale, bool tail, bool compute_grad) {
  // distillation reads no sampled token: the mask gives T
  const RowArgs r = row_args(logits, std::nullopt, mask_in, temperature, std::nullopt);
  const at::ScalarType acc = r.acc;
  const at::Tensor offsets = offsets_in.contiguous(), ids = ids_in.contiguous(),
                   lt = lt_in.contiguous();
  const int64_t N = r.N();
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.numel() == N + 1,
              "offsets: expected int64 [", N + 1, "], got ", offsets.scalar_type(), " ",
              offsets.sizes());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "token_ids: expected int64 [nnz]");
  TORCH_CHECK(lt.dim() == 1 && lt.scalar_type() == acc && lt.numel() == ids.numel(),
              "teacher_logprobs: expected ", acc, " [nnz] like token_ids");
  const at::Tensor weights = r.per_token(weights_in, "weights");
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0, "grad_scale: expected > 0");
  const at::Tensor& mask = r.mask;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const bool* m = mask.data_ptr<bool>();
  // (a chunk of rows passes a view of the whole offsets: they index token_ids, starting
  // anywhere; the Python layer checks the whole CSR)
  TORCH_CHECK(off[0] >= 0 && off[N] <= ids.numel(), "offsets: must lie in [0, nnz]");
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(off[i + 1] >= off[i], "offsets: decreasing at position ", i);
    if (!m[i]) continue;
    for (int64_t a = off[i]; a < off[i + 1]; ++a)
      TORCH_CHECK(id[a] >= 0 && id[a] < r.V, "token_ids: id ", id[a], " out of [0, ", r.V,
                  ") at entry ", a);
  }
  const auto opts = logits.options().dtype(acc);
  at::Tensor kl = at::empty({r.B, r.T}, opts), ps = at::empty({r.B, r.T}, opts),
             tt = at::empty({r.B, r.T}, opts);
  at::Tensor dlogits = compute_grad ? new_grad_buffer(logits.sizes(), logits.options())
                                    : at::empty({0}, logits.options());
  at::Tensor loss = at::empty({}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "distill_fwd",
                                  [&] {
    using T = acc_of<scalar_t>;
    scalar_t* out = compute_grad ? dlogits.data_ptr<scalar_t>() : nullptr;
    const int64_t oB = compute_grad ? dlogits.stride(0) : 0;
    const int64_t oT = compute_grad ? dlogits.stride(1) : 0;
    distill_rows<scalar_t>(logits, r, m, off, id, lt.data_ptr<T>(), weights.data_ptr<T>(),
                           temperature, grad_scale, tail, out, oB, oT, kl.data_ptr<T>(),
                           ps.data_ptr<T>(), tt.data_ptr<T>());
    const T* wp = weights.data_ptr<T>();
    const T* kp = kl.data_ptr<T>();
    double s = 0.0;  // loss = sum_i w_i kl_i, summed in double
    for (int64_t i = 0; i < N; ++i)
      if (m[i]) s += double(wp[i]) * double(kp[i]);
    *loss.data_ptr<T>() = T(s);
  });
  return {loss, kl, ps, tt, dlogits};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("distill_fwd", &distill_fwd); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
