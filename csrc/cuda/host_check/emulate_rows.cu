// Host emulation of the CUDA row kernels (row_reduce.cuh, row_kernels.cuh), for machines
// without a GPU: every "thread" of a block runs range_stats / grad_range / zero_range /
// scale_range in turn on the CPU, exactly the code the kernels run; the warp butterflies,
// group merges and chunk merges are emulated lane by lane IN THE KERNELS' ORDER, for both
// schedules (fused: `groups` groups per block taking chunks in turn; split: one block per
// chunk + a combine warp). Checked against a long-double reference:
//  - statistics (log_sum = log1p(rest), H, logp) and the gradient of random rows, every
//    dtype, every input and output 16-byte phase, in place too, -inf entries;
//  - batch invariance: the fused and split schedules, and every address phase of the same
//    row, give the same bits (logp, H, log_sum, every dlogit);
//  - every 16-byte block the shifted loads read lies inside the row (load hook below);
//  - confident rows (1 - p_top from 1e-3 down to 1e-12): logp, H and the token's gradient
//    to ~1e-6 relative; a leading chunk at finfo.min, at temperature 1 and 0.7;
//  - extreme logits (fp16/bf16 max, float 3e38, temperature 1e-10), NaN stays loud, all -inf
//    rows give NaN; scale_range (scale_grad_) rounds x * f once, at every phase;
//  - the per-token epilogue of ppo_loss (token_epilogue.cuh: fetch_token + token_epilogue,
//    the kernels' own code) for the loss menu: vanilla / cispo / sapo, k1..abs, k1+ / k3+,
//    kl_bias_correction, on-policy (old_logprobs null), entropy_weights, rollout IS
//    weights, grad_scale, masked rows; loss_tok, d loss / d logp, d loss / d H and the
//    token's own dlogit against a long-double surrogate (stop-gradients frozen) whose
//    derivative is taken by central differences.
// Not covered: real shuffles/barriers/launches (gpu_check.sh on a GPU), and the device's
// own libm: exp2f is 2 ulp on the device vs < 1 ulp in glibc (NOTES.md, tolerances).
//
// Build and run (tests/test_csrc.py does this):
//   TI=$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
//   nvcc -std=c++20 -O1 --expt-relaxed-constexpr -I csrc -I $TI \
//        csrc/cuda/host_check/emulate_rows.cu -o /tmp/emu && /tmp/emu
// To let the host compiler contract a * b + c into FMAs as nvcc does on the device, add
// -Xcompiler -mfma,-ffp-contract=fast.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

// Every 16-byte block a pack load reads must lie inside [g_lo, g_hi) (the row being swept).
static const char* g_lo = nullptr;
static const char* g_hi = nullptr;
static long g_bad_loads = 0, g_checked_loads = 0;
static void check_load(const void* p) {
  const char* c = static_cast<const char*>(p);
  g_checked_loads += g_lo != nullptr;
  if (g_lo && (c < g_lo || c + 16 > g_hi)) ++g_bad_loads;
}
#define PPO_CUDA_HOST_CHECK_LOAD(p) check_load(p)

#include "../row_reduce.cuh"
#include "../token_epilogue.cuh"

using namespace ppo_cuda;

static int g_fail = 0;
#define EXPECT(cond, ...)                        \
  do {                                           \
    if (!(cond)) {                               \
      if (g_fail < 25) std::printf(__VA_ARGS__); \
      ++g_fail;                                  \
    }                                            \
  } while (0)

template <typename T>
const char* name();
template <>
const char* name<float>() { return "float"; }
template <>
const char* name<double>() { return "double"; }
template <>
const char* name<c10::BFloat16>() { return "bf16"; }
template <>
const char* name<c10::Half>() { return "half"; }

template <typename A>
static bool same_bits(A a, A b) {
  return std::memcmp(&a, &b, sizeof(A)) == 0;
}
template <typename A>
static bool same_stats(const Stats<A>& a, const Stats<A>& b) {
  return same_bits(a.m, b.m) && same_bits(a.rest, b.rest) && same_bits(a.t, b.t);
}

// ---------------------------------------------------------------- lane-exact merges

// __shfl_xor butterfly over 32 lanes: at each step every lane merges with its partner's
// value from BEFORE the step (the shuffle reads registers, then each lane merges).
template <typename A>
static void emu_warp_merge(Stats<A>* lanes, A inv2) {
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    Stats<A> old[kWarpSize];
    std::copy(lanes, lanes + kWarpSize, old);
    for (int l = 0; l < kWarpSize; ++l) stats_merge(lanes[l], old[l ^ off], inv2);
  }
}

// group_merge of G threads' partials (per-thread order = thread order); returns lane 0's.
template <typename A>
static Stats<A> emu_group_merge(std::vector<Stats<A>> th, int G, A inv2) {
  const int gw = G / kWarpSize;
  for (int w = 0; w < gw; ++w) emu_warp_merge(th.data() + w * kWarpSize, inv2);
  if (G == kWarpSize) return th[0];
  Stats<A> first[kWarpSize];
  for (int l = 0; l < kWarpSize; ++l) first[l] = l < gw ? th[l * kWarpSize] : stats_empty<A>();
  emu_warp_merge(first, inv2);
  return first[0];
}

// merge_chunks: lane l merges chunks l, l + 32, ... then a butterfly; lane 0's result.
template <typename A>
static Stats<A> emu_merge_chunks(const std::vector<Stats<A>>& cs, A inv2) {
  Stats<A> lanes[kWarpSize];
  for (int l = 0; l < kWarpSize; ++l) {
    lanes[l] = stats_empty<A>();
    for (size_t c = l; c < cs.size(); c += kWarpSize) stats_merge(lanes[l], cs[c], inv2);
  }
  emu_warp_merge(lanes, inv2);
  return lanes[0];
}

// The statistics of chunk c as one group (or one partial_stats block) computes them.
template <typename T, typename A>
static Stats<A> emu_chunk(const T* row, int64_t V, const ChunkPlan& cp, int64_t c, A inv2) {
  std::vector<Stats<A>> th(cp.threads);
  const int64_t b = c * cp.chunk, e = std::min(V, b + cp.chunk);
  for (int lt = 0; lt < cp.threads; ++lt) th[lt] = range_stats(row, b, e, V, inv2, lt, cp.threads);
  return emu_group_merge(th, cp.threads, inv2);
}

// Split schedule: partial_stats_kernel per chunk, then combine_kernel.
template <typename T, typename A>
static Stats<A> emu_split(const T* row, int64_t V, A inv2) {
  const ChunkPlan cp = chunk_plan<T>(V);
  std::vector<Stats<A>> cs(cp.S);
  for (int64_t c = 0; c < cp.S; ++c) cs[c] = emu_chunk(row, V, cp, c, inv2);
  return emu_merge_chunks(cs, inv2);
}

// Fused schedule: `groups` groups, iteration c0 gives chunk c0 + g to group g, cs[] in smem,
// then warp 0 merges. (Groups run "concurrently" on the GPU; each chunk's work is private
// to its group, so any emulation order of the groups is exact.)
template <typename T, typename A>
static Stats<A> emu_fused(const T* row, int64_t V, A inv2, int groups) {
  const ChunkPlan cp = chunk_plan<T>(V);
  std::vector<Stats<A>> cs(cp.S);
  for (int64_t c0 = 0; c0 < cp.S; c0 += groups)
    for (int g = groups - 1; g >= 0; --g)
      if (c0 + g < cp.S) cs[c0 + g] = emu_chunk(row, V, cp, c0 + g, inv2);
  return emu_merge_chunks(cs, inv2);
}

// ---------------------------------------------------------------- reference

// Long-double statistics of z = x * inv over [begin, end); zmax and log s too, so that
// logp = (z_tok - zmax) - log s loses nothing to the size of lse.
struct Ref {
  long double zmax, log_s, ent;
};
static Ref ref_stats(const std::vector<double>& x, long double inv, int64_t begin, int64_t end) {
  long double m = -INFINITY;
  for (int64_t v = begin; v < end; ++v) m = std::max<long double>(m, x[v] * inv);
  long double rest = 0, t = 0;
  bool top = false;
  for (int64_t v = begin; v < end; ++v) {
    if (std::isinf(x[v])) continue;
    const long double d = (long double)x[v] * inv - m;
    if (d == 0 && !top) {
      top = true;
      continue;
    }
    const long double e = std::exp(d);
    rest += e;
    t += e * d;
  }
  Ref r;
  r.zmax = m;
  r.log_s = std::log1p(rest);
  r.ent = r.log_s - t / (1 + rest);
  return r;
}
static long double ref_logp(const Ref& r, double x_tok, long double inv) {
  return ((long double)x_tok * inv - r.zmax) - r.log_s;
}
// d loss / d logit_v for dlogp, dent (before the dtype's rounding); 1 - p as -expm1(logp).
static long double ref_grad(const Ref& r, double x_v, bool is_tok, long double inv,
                            long double dlogp, long double dent) {
  if (std::isinf(x_v)) return 0;
  const long double lp = ((long double)x_v * inv - r.zmax) - r.log_s;
  const long double p = std::exp(lp);
  const long double g = (is_tok ? -dlogp * std::expm1(lp) : -p * dlogp) -
                        (p == 0 ? 0.0L : p * dent * (lp + r.ent));
  return g * inv;
}
static bool close(double got, long double want, double rtol, double atol) {
  if (std::isnan(got) || std::isnan((double)want)) return false;
  if (std::isinf(got) || std::isinf((double)want)) return got == (double)want;
  return std::fabs((long double)got - want) <= atol + rtol * std::fabs(want);
}

// ---------------------------------------------------------------- one row, every schedule

// A row stored at element phase `shift` of a 16-byte aligned buffer (T per element).
template <typename T>
struct RowBuf {
  std::vector<Pack<T>> buf;
  T* p;
  RowBuf(int64_t V, int shift) : buf((V + 2 * Pack<T>::N) / Pack<T>::N + 2) {
    p = reinterpret_cast<T*>(buf.data()) + shift;
  }
};

template <typename T>
static void arm_loads(const T* row, int64_t V) {
  g_lo = reinterpret_cast<const char*>(row);
  g_hi = reinterpret_cast<const char*>(row + V);
}
static void disarm_loads() { g_lo = g_hi = nullptr; }

// Cluster schedule (cluster_rows_kernel): block `rank` of C stages its slice (row_slice,
// stage_range by nthr threads) into an aligned copy, reduces its chunks from the copy in
// rounds of `groups`, block 0 merges all chunks. The copies stay in `copies` for the
// gradient (emu_cluster_grad).
template <typename T>
using Copy = std::vector<Pack<T>>;

template <typename T, typename A>
static Stats<A> emu_cluster_stats(const T* row, int64_t V, A inv2, int C, int nthr,
                                  std::vector<Copy<T>>& copies) {
  const ChunkPlan cp = chunk_plan<T>(V);
  std::vector<Stats<A>> cs(cp.S, stats_empty<A>());
  copies.assign(C, Copy<T>());
  const int groups = static_cast<int>(std::min<int64_t>(slice_chunks(cp, C), 512 / cp.threads));
  for (int rank = 0; rank < C; ++rank) {
    const RowSlice sl = row_slice(cp, V, C, rank);
    Copy<T>& cpy = copies[rank];
    cpy.resize((sl.e1 - sl.e0) / Pack<T>::N + 1);
    T* s = reinterpret_cast<T*>(cpy.data());
    arm_loads(row, V);
    for (int tid = 0; tid < nthr; ++tid) stage_range(s, row, sl.e0, sl.e1, V, tid, nthr);
    arm_loads(s, sl.e1 - sl.e0);
    for (int64_t c0 = sl.c0; c0 < sl.c1; c0 += groups)
      for (int g = 0; g < groups; ++g) {
        const int64_t c = c0 + g;
        if (c >= sl.c1) continue;
        const int64_t cb = c * cp.chunk, ce = std::min(V, cb + cp.chunk);
        std::vector<Stats<A>> th(cp.threads);
        for (int lt = 0; lt < cp.threads; ++lt)
          th[lt] = range_stats(s + (cb - sl.e0), int64_t(0), ce - cb, ce - cb, inv2, lt,
                               cp.threads);
        cs[c] = emu_group_merge(th, cp.threads, inv2);
      }
  }
  disarm_loads();
  return emu_merge_chunks(cs, inv2);
}

// Each block's gradient sweep from its copy: GradRow's token column made slice-relative,
// nthr threads, as cluster_rows_kernel does it.
template <typename T, typename A>
static void emu_cluster_grad(const std::vector<Copy<T>>& copies, T* out, int64_t V,
                             const GradRow<A>& g0, Temp<A> tp, int nthr) {
  const ChunkPlan cp = chunk_plan<T>(V);
  const int C = static_cast<int>(copies.size());
  for (int rank = 0; rank < C; ++rank) {
    const RowSlice sl = row_slice(cp, V, C, rank);
    const T* s = reinterpret_cast<const T*>(copies[rank].data());
    GradRow<A> g = g0;
    g.tok = g.tok >= sl.e0 ? static_cast<int32_t>(g.tok - sl.e0) : -1;
    arm_loads(s, sl.e1 - sl.e0);
    for (int tid = 0; tid < nthr; ++tid)
      grad_range<true>(s, out + sl.e0, 0, sl.e1 - sl.e0, sl.e1 - sl.e0, g, tp, tid, nthr);
  }
  disarm_loads();
}

// Everything the kernels compute for one row: stats (fused with 1 and 2 groups, split; all
// must agree bit for bit), logp, GradRow, and the gradient written by nthr threads (backwards
// sweep) over the row as one range (fused) and as the chunks (split grad kernel).
template <typename T>
struct RowOut {
  using A = acc_of<T>;
  Stats<A> st;
  RowStats<A> rs;
  A logp;
  GradRow<A> g;
  std::vector<T> grad;
};

template <typename T>
static RowOut<T> run_row(const T* in, T* out, int64_t V, int64_t tok, Temp<acc_of<T>> tp,
                         acc_of<T> dlogp, acc_of<T> dent, int nthr, const char* label) {
  using A = acc_of<T>;
  RowOut<T> r;
  arm_loads(in, V);
  const Stats<A> s_split = emu_split(in, V, tp.inv2);
  const Stats<A> s_f1 = emu_fused(in, V, tp.inv2, 1);
  const Stats<A> s_f2 = emu_fused(in, V, tp.inv2, 2);
  EXPECT(same_stats(s_split, s_f1) && same_stats(s_split, s_f2),
         "[%s %s V=%lld] fused and split statistics differ\n", label, name<T>(), (long long)V);
  r.st = s_split;
  r.rs = stats_finish(r.st);
  r.logp = token_logp(static_cast<A>(in[tok]), r.rs.xmax, r.rs.log_s, tp.inv);
  r.g = GradRow<A>{r.rs.xmax, r.rs.log_s2, r.rs.entropy, dlogp, dent,
                   token_grad(r.logp, r.rs.entropy, dlogp, dent, tp.inv), tok_column(tok, V)};
  // fused gradient sweep: one range, nthr threads
  const bool inplace = in == out;
  std::vector<T> saved(in, in + V);
  if (!inplace)
    for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
  arm_loads(in, V);
  for (int tid = 0; tid < nthr; ++tid) grad_range(in, out, 0, V, V, r.g, tp, tid, nthr);
  r.grad.assign(out, out + V);
  // split grad kernel: chunk by chunk, chunk_plan's threads (restore the input if in place)
  if (inplace) std::copy(saved.begin(), saved.end(), out);
  else
    for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
  const ChunkPlan cp = chunk_plan<T>(V);
  for (int64_t c = 0; c < cp.S; ++c)
    for (int tid = 0; tid < cp.threads; ++tid)
      grad_range(in, out, c * cp.chunk, std::min(V, (c + 1) * cp.chunk), V, r.g, tp, tid,
                 cp.threads);
  int diff = 0;
  for (int64_t v = 0; v < V; ++v) diff += !same_bits(out[v], r.grad[v]);
  EXPECT(diff == 0, "[%s %s V=%lld] fused and chunked gradient differ in %d entries\n", label,
         name<T>(), (long long)V, diff);
  // cluster path: 2, 4 and 8 blocks, statistics and gradient from the staged copies
  for (int C : {2, 4, 8}) {
    if (inplace) std::copy(saved.begin(), saved.end(), out);
    else
      for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
    std::vector<Copy<T>> copies;
    const Stats<A> s_cl = emu_cluster_stats(in, V, tp.inv2, C, nthr, copies);
    EXPECT(same_stats(s_split, s_cl), "[%s %s V=%lld C=%d] cluster statistics differ\n", label,
           name<T>(), (long long)V, C);
    emu_cluster_grad(copies, out, V, r.g, tp, nthr);
    diff = 0;
    for (int64_t v = 0; v < V; ++v) diff += !same_bits(out[v], r.grad[v]);
    EXPECT(diff == 0, "[%s %s V=%lld C=%d] cluster gradient differs in %d entries\n", label,
           name<T>(), (long long)V, C, diff);
  }
  if (inplace) std::copy(saved.begin(), saved.end(), out);
  disarm_loads();
  return r;
}

template <typename T>
static Temp<acc_of<T>> temp_of(double temperature) {
  using A = acc_of<T>;
  const double inv = 1.0 / temperature;
  return {static_cast<A>(inv),
          static_cast<A>(std::min(inv * kLog2e, (double)std::numeric_limits<A>::max()))};
}

// Checks a row against the long-double reference: log_sum, H, logp, every gradient entry.
// rt: relative tolerance of the statistics; gt: of the gradient (plus T's rounding).
template <typename T>
static void check_vs_ref(const RowOut<T>& r, const std::vector<double>& x, int64_t tok,
                         Temp<acc_of<T>> tp, double rt, double gt, const char* label) {
  using A = acc_of<T>;
  const int64_t V = static_cast<int64_t>(x.size());
  const long double inv = tp.inv;
  const Ref rr = ref_stats(x, inv, 0, V);
  const long double rlogp = ref_logp(rr, x[tok], inv);
  EXPECT(close((double)r.rs.log_s, rr.log_s, rt, 1e-30) && close((double)r.logp, rlogp, rt, 1e-30) &&
             close((double)r.rs.entropy, rr.ent, rt, 1e-6 * rt),
         "[%s %s V=%lld] log_sum %.9g vs %.9Lg, logp %.9g vs %.9Lg, H %.9g vs %.9Lg\n", label,
         name<T>(), (long long)V, (double)r.rs.log_s, rr.log_s, (double)r.logp, rlogp,
         (double)r.rs.entropy, rr.ent);
  // the bits the kernels must write: the same formula, entry by entry
  int bad_bits = 0, bad_ref = 0;
  double worst_got = 0, worst_want = 0;
  for (int64_t v = 0; v < V; ++v) {
    const A want_bits = v == tok ? r.g.g_tok
                                 : dense_grad(static_cast<A>(x[v]), r.g.xmax, r.g.log_s2,
                                              tp.inv2, dense_coef(r.g.entropy, r.g.dlogp,
                                                                  r.g.dent, tp.inv));
    bad_bits += !same_bits(r.grad[v], static_cast<T>(want_bits));
    const long double g = ref_grad(rr, x[v], v == tok, inv, r.g.dlogp, r.g.dent);
    const double want = static_cast<double>(static_cast<T>(static_cast<double>(g)));
    const double got = static_cast<double>(r.grad[v]);
    // the size of the terms that cancel in dlogp + dent (log p_v + H): the conditioning
    double lp = 0, p = 0;
    if (!std::isinf(x[v])) {
      lp = (double)(((long double)x[v] * inv - rr.zmax) - rr.log_s);
      p = std::exp(lp);
    }
    const double scale =
        std::fabs(want) + (double)inv * (p * (std::fabs((double)r.g.dlogp) +
                                              std::fabs((double)r.g.dent) *
                                                  (std::fabs(lp) + std::fabs((double)rr.ent))) +
                                         1e-7 * (std::fabs((double)r.g.dlogp) +
                                                 std::fabs((double)r.g.dent)));
    if (!close(got, want, 0.0, gt * scale)) {
      if (!bad_ref) worst_got = got, worst_want = want;
      ++bad_ref;
    }
  }
  EXPECT(bad_bits == 0, "[%s %s V=%lld] %d gradient entries differ from the formula\n", label,
         name<T>(), (long long)V, bad_bits);
  EXPECT(bad_ref == 0, "[%s %s V=%lld] %d gradient entries off the reference, e.g. %g vs %g\n",
         label, name<T>(), (long long)V, bad_ref, worst_got, worst_want);
}

template <typename T>
static double stat_tol() { return sizeof(acc_of<T>) == 8 ? 1e-12 : 2e-6; }
template <typename T>
static double grad_tol() { return sizeof(T) == 2 ? 1e-2 : (sizeof(T) == 4 ? 2e-5 : 1e-11); }

// ---------------------------------------------------------------- random rows

template <typename T>
static void random_rows(std::mt19937& rng) {
  using A = acc_of<T>;
  constexpr int N = Pack<T>::N;
  const int64_t Vs[] = {1, 2, 7, 13, 64, 1000, 4099, 9001, 32003};
  int cases = 0, vi = 0;
  for (int64_t V : Vs) {
    ++vi;
    std::normal_distribution<double> nd(0.0, 3.0);
    std::vector<double> xs(V);
    for (auto& v : xs) v = static_cast<double>(static_cast<T>(nd(rng)));
    if (V > 8)
      for (int k = 0; k < 3; ++k) xs[rng() % V] = -INFINITY;
    int64_t tok = rng() % V;
    while (std::isinf(xs[tok])) tok = (tok + 1) % V;
    const Temp<A> tp = temp_of<T>(0.7);
    // every other V without an entropy term: grad_range's p * b sweep (c.a == 0)
    const A dlogp = static_cast<A>(0.37), dent = static_cast<A>(vi % 2 ? -0.11 : 0.0);
    RowOut<T> first;
    for (int si = 0; si < N; ++si)
      for (int so : {si, (si * 3 + 1) % N, -1}) {  // -1: in place
        RowBuf<T> bi(V, si), bo(V, so < 0 ? 0 : so);
        for (int64_t v = 0; v < V; ++v) bi.p[v] = static_cast<T>(xs[v]);
        for (int nthr : {32, 96}) {
          T* out = so < 0 ? bi.p : bo.p;
          const RowOut<T> r = run_row(bi.p, out, V, tok, tp, dlogp, dent, nthr, "random");
          check_vs_ref(r, xs, tok, tp, stat_tol<T>(), grad_tol<T>(), "random");
          ++cases;
          if (si == 0 && so == 0 && nthr == 32) {
            first = r;
            continue;
          }
          // batch invariance across address phases: the same bits at every phase
          int diff = 0;
          for (int64_t v = 0; v < V; ++v) diff += !same_bits(r.grad[v], first.grad[v]);
          EXPECT(same_stats(r.st, first.st) && same_bits(r.logp, first.logp) && diff == 0,
                 "[%s V=%lld phase %d/%d nthr=%d] bits differ from phase 0 (%d grad entries)\n",
                 name<T>(), (long long)V, si, so, nthr, diff);
        }
        // zero sweep writes every entry
        T* out = so < 0 ? bi.p : bo.p;
        for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
        for (int tid = 0; tid < 64; ++tid) zero_range(out, 0, V, tid, 64);
        int bad = 0;
        for (int64_t v = 0; v < V; ++v) bad += !(static_cast<double>(out[v]) == 0.0);
        EXPECT(bad == 0, "[%s V=%lld] zero sweep left %d entries\n", name<T>(), (long long)V, bad);
      }
  }
  std::printf("%-8s %d random-row cases\n", name<T>(), cases);
}

// ---------------------------------------------------------------- confident rows

// The top token at +delta over a row of randn: 1 - p_top from ~1e-3 to ~1e-12. logp, H and
// the token's own gradient must keep ~1e-6 relative digits (log(1 + rest) lost them all).
template <typename T>
static void confident_rows() {
  using A = acc_of<T>;
  std::mt19937 rng(7);
  int cases = 0;
  const int64_t V = 32000;
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> base(V);
  for (auto& v : base) v = static_cast<double>(static_cast<T>(nd(rng)));
  for (double delta : {17.0, 22.0, 28.0, 33.0, 38.0}) {
    std::vector<double> xs = base;
    const int64_t tok = 12345;
    xs[tok] = static_cast<double>(static_cast<T>(delta));
    const Temp<A> tp = temp_of<T>(1.0);
    RowBuf<T> b(V, 1);
    for (int64_t v = 0; v < V; ++v) b.p[v] = static_cast<T>(xs[v]);
    for (double dl : {1.0, 0.0}) {  // with and without the logp term
      const RowOut<T> r = run_row(b.p, b.p, V, tok, tp, static_cast<A>(dl), static_cast<A>(-0.3),
                                  256, "confident");
      const Ref rr = ref_stats(xs, tp.inv, 0, V);
      const long double rlogp = ref_logp(rr, xs[tok], tp.inv);
      const long double rg = ref_grad(rr, xs[tok], true, tp.inv, dl, -0.3);
      const double rt = sizeof(A) == 8 ? 1e-13 : 1e-6;
      EXPECT(close((double)r.logp, rlogp, rt, 0) && close((double)r.rs.entropy, rr.ent, rt, 0) &&
                 close((double)r.g.g_tok, rg, rt, 0),
             "[confident %s delta=%g] logp %.9g vs %.9Lg (1-p %.3Lg), H %.9g vs %.9Lg, "
             "g_tok %.9g vs %.9Lg\n",
             name<T>(), delta, (double)r.logp, rlogp, -std::expm1(rlogp), (double)r.rs.entropy,
             rr.ent, (double)r.g.g_tok, rg);
      check_vs_ref(r, xs, tok, tp, rt, grad_tol<T>(), "confident");
      ++cases;
    }
  }
  std::printf("%-8s %d confident-row cases\n", name<T>(), cases);
}

// ---------------------------------------------------------------- finfo.min chunks

// The first chunk (or more) at finfo(T).min, the rest normal (HF-style masks): every merge
// rebases from a max near -3.4e38, where dm * s overflows. Must stay finite.
template <typename T>
static void finfo_min_rows() {
  using A = acc_of<T>;
  std::mt19937 rng(11);
  int cases = 0;
  for (int64_t V : {int64_t(32768), int64_t(5000)}) {
    const ChunkPlan cp = chunk_plan<T>(V);
    std::normal_distribution<double> nd(0.0, 2.0);
    std::vector<double> xs(V);
    const double lo = static_cast<double>(std::numeric_limits<T>::lowest());
    const int64_t nmin = std::max<int64_t>(cp.chunk, V / 2);
    for (int64_t v = 0; v < V; ++v)
      xs[v] = v < nmin ? lo : static_cast<double>(static_cast<T>(nd(rng)));
    const int64_t tok = V - 17;
    for (double temp : {1.0, 0.7}) {
      const Temp<A> tp = temp_of<T>(temp);
      RowBuf<T> b(V, 0), o(V, 0);
      for (int64_t v = 0; v < V; ++v) b.p[v] = static_cast<T>(xs[v]);
      const RowOut<T> r = run_row(b.p, o.p, V, tok, tp, static_cast<A>(0.5), static_cast<A>(-0.2),
                                  128, "finfo.min");
      bool finite = std::isfinite((double)r.logp) && std::isfinite((double)r.rs.entropy);
      for (int64_t v = 0; v < V; ++v) finite &= std::isfinite(static_cast<double>(r.grad[v]));
      EXPECT(finite, "[finfo.min %s V=%lld T=%g] non-finite logp %g / H %g / grad\n", name<T>(),
             (long long)V, temp, (double)r.logp, (double)r.rs.entropy);
      check_vs_ref(r, xs, tok, tp, stat_tol<T>(), grad_tol<T>(), "finfo.min");
      ++cases;
    }
  }
  std::printf("%-8s %d finfo.min cases\n", name<T>(), cases);
}

// ---------------------------------------------------------------- extreme logits

template <typename T>
static void check_extreme(const char* label, const std::vector<double>& xs0, int64_t tok,
                          double temp) {
  using A = acc_of<T>;
  const int64_t V = static_cast<int64_t>(xs0.size());
  std::vector<double> xs(V);
  for (int64_t v = 0; v < V; ++v) xs[v] = static_cast<double>(static_cast<T>(xs0[v]));
  const Temp<A> tp = temp_of<T>(temp);
  for (int shift : {0, 1}) {
    RowBuf<T> b(V, shift), o(V, shift);
    for (int64_t v = 0; v < V; ++v) b.p[v] = static_cast<T>(xs[v]);
    for (int nthr : {1, 32, 96}) {
      const RowOut<T> r = run_row(b.p, o.p, V, tok, tp, static_cast<A>(0.37),
                                  static_cast<A>(-0.11), nthr, label);
      check_vs_ref(r, xs, tok, tp, sizeof(A) == 8 ? 1e-13 : 2e-6, grad_tol<T>(), label);
    }
  }
}

static void extreme_cases() {
  std::mt19937 rng(99);
  int cases = 0;
  {  // fp16 at +-65504: ties at the max (token one of them), a few just below it
    const int64_t V = 1000;
    std::vector<double> xs(V, -65504.0);
    xs[5] = xs[517] = xs[998] = 65504.0;
    xs[40] = 65472.0;
    xs[41] = 65440.0;
    xs[700] = 65504.0 - 32.0 * 3;
    for (double temp : {1.0, 0.7, 40.0}) {
      check_extreme<c10::Half>("fp16 65504, token at max", xs, 517, temp);
      check_extreme<c10::Half>("fp16 65504, token below max", xs, 40, temp);
      check_extreme<float>("fp16 65504 as float", xs, 517, temp);
      cases += 3;
    }
    std::reverse(xs.begin(), xs.end());
    check_extreme<c10::Half>("fp16 65504 reversed", xs, V - 1 - 517, 1.0);
    ++cases;
  }
  {  // bf16 max and float 3e38: four entries at the max, logp = -log 4
    const double bmax = static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    const int64_t V = 300;
    std::vector<double> xs(V, -bmax);
    xs[100] = xs[101] = xs[250] = xs[299] = bmax;
    check_extreme<c10::BFloat16>("bf16 max", xs, 250, 1.0);
    check_extreme<c10::BFloat16>("bf16 max, T=2", xs, 250, 2.0);
    std::vector<double> xf(V, -3e38);
    xf[3] = xf[150] = xf[151] = xf[290] = 3e38;
    check_extreme<float>("float 3e38", xf, 150, 1.0);
    xf[7] = 3e38 * 0.999999;
    check_extreme<float>("float 3e38 + near", xf, 7, 1.0);
    cases += 4;
  }
  {  // temperature 1e-10 and 1e-3: the max entry must give d = 0 exactly
    const int64_t V = 1000;
    std::normal_distribution<double> nd(0.0, 3.0);
    std::vector<double> xs(V);
    for (auto& v : xs) v = std::max(-11.0, std::min(11.0, nd(rng)));
    xs[321] = 12.0;
    auto run = [&](const char* label, int64_t tok) {
      for (double temp : {1e-10, 1e-3}) {
        check_extreme<float>(label, xs, tok, temp);
        check_extreme<c10::BFloat16>(label, xs, tok, temp);
        check_extreme<c10::Half>(label, xs, tok, temp);
        check_extreme<double>(label, xs, tok, temp);
        cases += 4;
      }
    };
    run("small T, token at max", 321);
    run("small T, token below max", 10);
    xs[654] = 12.0;
    run("small T, two tied maxima", 654);
  }
  {  // the 5-logit row of test_tiny_temperature_gives_sane_logprobs
    const std::vector<double> xs = {1.5410, -0.2934, -2.1788, 0.5684, -1.0845};
    for (double temp : {1e-10, 1e-3})
      for (int64_t tok = 0; tok < 5; ++tok) {
        check_extreme<float>("5-logit row", xs, tok, temp);
        ++cases;
      }
  }
  std::printf("%-8s %d cases\n", "extreme", cases);
}

// ---------------------------------------------------------------- special rows

static void special_cases() {
  RowBuf<float> b(200, 1);
  float* x = b.p;
  const Temp<float> tp = temp_of<float>(1.0);
  for (int v = 0; v < 200; ++v) x[v] = -INFINITY;
  arm_loads(x, 200);
  const Stats<float> none = emu_split(x, 200, tp.inv2);
  RowStats<float> rs = stats_finish(none);
  EXPECT(std::isnan(rs.entropy) && std::isinf(rs.log_s), "all -inf row: log_sum %g H %g\n",
         rs.log_s, rs.entropy);
  x[150] = 2.5f;
  rs = stats_finish(emu_split(x, 200, tp.inv2));
  EXPECT(rs.log_s == 0.0f && rs.entropy == 0.0f && rs.xmax == 2.5f,
         "one finite entry: log_sum %g H %g\n", rs.log_s, rs.entropy);
  x[10] = NAN;  // a NaN logit must not vanish, wherever it sits
  EXPECT(std::isnan(stats_finish(emu_split(x, 200, tp.inv2)).log_s), "NaN logit dropped\n");
  x[10] = -INFINITY;
  x[199] = NAN;
  EXPECT(std::isnan(stats_finish(emu_fused(x, 200, tp.inv2, 2)).log_s), "NaN tail dropped\n");
  disarm_loads();
  // V = 1: logp and H exactly 0, token gradient exactly 0
  RowBuf<float> one(1, 3);
  one.p[0] = 5.0f;
  const RowOut<float> r = run_row(one.p, one.p, 1, 0, tp, 1.0f, 1.0f, 32, "V=1");
  EXPECT(r.logp == 0.0f && r.rs.entropy == 0.0f && r.grad[0] == 0.0f,
         "V=1: logp %g H %g grad %g\n", r.logp, r.rs.entropy, (double)r.grad[0]);
}

// ---------------------------------------------------------------- per-token epilogue

// One configuration of the loss menu (the op's scalar options and which inputs exist).
struct EpiCfg {
  const char* label;
  int policy_loss, kl_estimator;
  bool kl_bias, has_old, has_ref, has_isw, has_went;
  double eps_lo, eps_hi, dual_c, kl_coef, ent_coef, tau_pos, tau_neg, grad_scale;
};

// The per-token loss as a long-double function of the token's logprob x, every
// stop-gradient frozen at x0 (the value the kernel saw): S(x0; x0) is loss_tok and
// dS/dx at x0 is d loss_tok / d logp. Written from the papers' formulas, not ppo_math.h:
//   vanilla  max(-rho A, -clip(rho, 1 - el, 1 + eh) A), then min(., -c A) where A < 0
//   cispo    -sg(clip(rho)) A x;   sapo  -(4 / tau) sigmoid(tau (rho - 1)) A
//   rho = exp(clamp(x - old, +-20)), old = sg(x) when on-policy
//   kl k1 d, k2 d^2 / 2, k3 exp(-c) - 1 + c (c = clamp(d, +-20)), abs |d|, d = x - ref;
//   k1+ / k3+: k1 / k3 at x0 plus k2(x) - k2(x0); bias correction: kl * rho
struct EpiTok {
  long double old, adv, ref, isw;  // old: NaN when on-policy
};
// (not std::min / max: --expt-relaxed-constexpr makes those __host__ __device__, and nvcc
// warns about long double in device code)
static long double ld_min(long double a, long double b) { return a < b ? a : b; }
static long double ld_max(long double a, long double b) { return a > b ? a : b; }
static long double ld_clamp(long double x, long double lim) { return ld_max(-lim, ld_min(lim, x)); }
static long double epi_rho(const EpiCfg& c, const EpiTok& t, long double x, long double x0) {
  return std::exp(ld_clamp(x - (c.has_old ? t.old : x0), 20.0L));
}
static long double epi_kl(int est, long double d) {
  switch (est) {
    case 0: return d;
    case 1: return 0.5L * d * d;
    case 3: return std::fabs(d);
    default: {
      const long double cl = ld_clamp(d, 20.0L);
      return std::expm1(-cl) + cl;
    }
  }
}
static long double epi_surrogate(const EpiCfg& c, const EpiTok& t, long double x,
                                 long double x0) {
  const long double rho = epi_rho(c, t, x, x0), A = t.adv;
  const long double lo = 1.0L - c.eps_lo, hi = 1.0L + c.eps_hi;
  long double pg;
  if (c.policy_loss == 1) {
    pg = -ld_max(lo, ld_min(hi, epi_rho(c, t, x0, x0))) * A * x;
  } else if (c.policy_loss == 2) {
    const long double tau = A > 0 ? c.tau_pos : c.tau_neg;
    pg = -(4.0L / tau) / (1.0L + std::exp(-tau * (rho - 1.0L))) * A;
  } else {
    pg = ld_max(-rho * A, -ld_max(lo, ld_min(hi, rho)) * A);
    if (c.dual_c > 0 && A < 0) pg = ld_min(pg, -c.dual_c * A);
  }
  long double loss = t.isw * pg;
  if (c.has_ref) {
    long double kl;
    if (c.kl_estimator == 4 || c.kl_estimator == 5)
      kl = epi_kl(c.kl_estimator == 4 ? 0 : 2, x0 - t.ref) + epi_kl(1, x - t.ref) -
           epi_kl(1, x0 - t.ref);
    else
      kl = epi_kl(c.kl_estimator, x - t.ref);
    loss += c.kl_coef * (c.kl_bias ? kl * rho : kl);
  }
  return loss;
}

template <typename T>
static void epilogue_cases(std::mt19937& rng) {
  using A = acc_of<T>;
  const EpiCfg cfgs[] = {
      // label, pl, kl, bias, old, ref, isw, went, el, eh, dual, klc, entc, tau+, tau-, gs
      {"vanilla k3 dual", 0, 2, false, true, true, true, false, 0.2, 0.28, 3.0, 0.1, 0.01, 1, 1.05, 1.0},
      {"vanilla k1+", 0, 4, false, true, true, false, false, 0.2, 0.2, 0.0, 0.3, 0.0, 1, 1.05, 0.5},
      {"vanilla k3+", 0, 5, false, true, true, true, true, 0.2, 0.28, 0.0, 0.3, 0.02, 1, 1.05, 1.0},
      {"vanilla k3 bias", 0, 2, true, true, true, false, false, 0.2, 0.28, 3.0, 0.5, 0.0, 1, 1.05, 1.0},
      {"vanilla abs bias went", 0, 3, true, true, true, true, true, 0.1, 0.3, 0.0, 0.2, 0.05, 1, 1.05, 2.0},
      {"cispo trl k1", 1, 0, false, true, true, false, false, 1.0, 4.0, 0.0, 0.1, 0.0, 1, 1.05, 1.0},
      {"cispo no ref", 1, 2, false, true, false, true, true, 0.2, 0.28, 0.0, 0.0, 0.01, 1, 1.05, 1.0},
      {"cispo k3+ bias", 1, 5, true, true, true, true, false, 0.2, 0.28, 0.0, 0.2, 0.0, 1, 1.05, 0.25},
      {"sapo k2", 2, 1, false, true, true, false, false, 0.2, 0.2, 0.0, 0.1, 0.0, 1.0, 1.05, 1.0},
      {"sapo k3 bias", 2, 2, true, true, true, true, true, 0.2, 0.2, 0.0, 0.3, 0.02, 0.5, 2.0, 1.0},
      {"on-policy vanilla k3 bias", 0, 2, true, false, true, true, true, 0.2, 0.28, 3.0, 0.2, 0.01, 1, 1.05, 1.0},
      {"on-policy cispo k1+", 1, 4, false, false, true, false, false, 0.2, 0.28, 0.0, 0.2, 0.0, 1, 1.05, 1.0},
      {"on-policy sapo k2 bias", 2, 1, true, false, true, true, false, 0.2, 0.2, 0.0, 0.3, 0.0, 1.0, 1.05, 0.5},
  };
  const int64_t n = 200, V = 37;
  const Temp<A> tp = temp_of<T>(0.8);
  int checked = 0, kinks = 0;
  for (const EpiCfg& c : cfgs) {
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ud(0.0, 1.0);
    std::vector<T> logits(n * V);
    for (auto& v : logits) v = static_cast<T>(2.0 * nd(rng));
    std::vector<int64_t> tok(n);
    std::vector<uint8_t> mask_b(n);
    for (int64_t i = 0; i < n; ++i) {
      tok[i] = rng() % V;
      mask_b[i] = ud(rng) > 0.1;
    }
    bool mask[n];
    for (int64_t i = 0; i < n; ++i) mask[i] = mask_b[i];
    // the kernel's statistics of every row first: old / ref are drawn around its logp
    std::vector<RowStats<A>> rs(n);
    std::vector<double> lp(n);
    for (int64_t i = 0; i < n; ++i) {
      rs[i] = stats_finish(emu_split(logits.data() + i * V, V, tp.inv2));
      lp[i] = (double)token_logp(static_cast<A>(logits[i * V + tok[i]]), rs[i].xmax, rs[i].log_s,
                                 tp.inv);
    }
    std::vector<A> old(n), adv(n), w(n), went(n), ref(n), isw(n);
    std::vector<A> o_logp(n, A(-7)), o_ent(n, A(-7)), o_loss(n, A(-7));
    for (int64_t i = 0; i < n; ++i) {
      // log-ratios mostly inside +-1 (both sides of the clip band), a few beyond the clamp
      const double far = i % 50 == 7 ? (i % 100 == 7 ? 25.0 : -25.0) : 0.0;
      old[i] = static_cast<A>(lp[i] - 0.4 * nd(rng) - far);
      ref[i] = static_cast<A>(lp[i] - 0.6 * nd(rng) + (i % 50 == 13 ? -24.0 : 0.0));
      adv[i] = static_cast<A>(nd(rng));
      w[i] = static_cast<A>(0.01 * ud(rng));
      went[i] = static_cast<A>(0.02 * ud(rng));
      isw[i] = static_cast<A>(0.5 + ud(rng));
    }
    RowsView<T> rv{};
    rv.logits = logits.data();
    rv.sB = n * V;
    rv.sT = V;
    rv.tokens = tok.data();
    rv.mask = mask;
    rv.B = 1;
    rv.T = rv.Tl = n;
    rv.V = V;
    TokenIO<A> io{};
    io.mode = kModePpo;
    io.old_logp = c.has_old ? old.data() : nullptr;
    io.adv = adv.data();
    io.weights = w.data();
    io.w_ent = c.has_went ? went.data() : nullptr;
    io.is_w = c.has_isw ? isw.data() : nullptr;
    io.ref_logp = c.has_ref ? ref.data() : nullptr;
    {
      using namespace ppo::slot;
      double f[kNumFloat] = {};
      int64_t k[kNumInt] = {};
      f[clip_eps_low] = c.eps_lo;
      f[clip_eps_high] = c.eps_hi;
      f[dual_clip_c] = c.dual_c;
      f[kl_coef] = c.kl_coef;
      f[entropy_coef] = c.ent_coef;
      f[temperature] = 1.0;
      f[grad_scale] = c.grad_scale;
      f[sapo_tau_pos] = c.tau_pos;
      f[sapo_tau_neg] = c.tau_neg;
      k[policy_loss] = c.policy_loss;
      k[kl_estimator] = c.kl_estimator;
      k[kl_bias_correction] = c.kl_bias;
      io.params = ppo::policy_params(f, k, c.has_ref, c.has_isw);
    }
    io.grad_scale = static_cast<A>(c.grad_scale);
    io.logp = o_logp.data();
    io.entropy = o_ent.data();
    io.loss_tok = o_loss.data();
    const double rt = sizeof(A) == 8 ? 1e-12 : 3e-6;
    // the k3 value's series (ppo_math.h expm1_minus_x, 11 terms) is 4e-10 relative at
    // |delta| -> 1 in double: the KL part gets that much (float: its own rounding)
    const double rt_kl = sizeof(A) == 8 ? 1e-9 : 3e-6;
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!mask[i]) {  // the kernels' order: mask first, nothing of the row is read
        token_epilogue_masked(io, i);
        bad += !(o_logp[i] == A(0) && o_ent[i] == A(0) && o_loss[i] == A(0));
        continue;
      }
      const TokenIn<A> tin = fetch_token(io, rv, logits.data() + i * V, i);
      const GradRow<A> g = token_epilogue(io, i, tin, rs[i], tp);
      // the row's statistics and logp: the kernel's, passed through
      bad += !(same_bits(o_logp[i], static_cast<A>(lp[i])) && same_bits(o_ent[i], rs[i].entropy));
      const long double x0 = lp[i], H = rs[i].entropy;
      const EpiTok t{c.has_old ? (long double)old[i] : NAN, (long double)adv[i],
                     (long double)ref[i], c.has_isw ? (long double)isw[i] : 1.0L};
      const long double s0 = epi_surrogate(c, t, x0, x0);
      const long double want_loss = s0 - c.ent_coef * H;
      // five-point central difference (error ~h^4 f^(5) + eps / h ~ 1e-14 relative)
      const long double h = 1e-5L, h2 = 1e-7L;
      const long double sp = epi_surrogate(c, t, x0 + h, x0), sm = epi_surrogate(c, t, x0 - h, x0);
      const long double sp2 = epi_surrogate(c, t, x0 + 2 * h, x0);
      const long double sm2 = epi_surrogate(c, t, x0 - 2 * h, x0);
      const long double d_c = (8 * (sp - sm) - (sp2 - sm2)) / (12 * h);
      // a kink of the loss (clip edge, dual clip, |d|, the clamps) within 2h: no derivative.
      // The jump of the one-sided differences is ~h f'' where S is smooth (so 100 times
      // smaller at h2 = h / 100) and does not shrink at a kink; the second term is the
      // rounding of S (S ~ e^20 |A| on a clamped token) in j2.
      const long double j1 = (sp2 - s0) / (2 * h) - (s0 - sm2) / (2 * h);
      const long double j2 = (epi_surrogate(c, t, x0 + 2 * h2, x0) - s0) / (2 * h2) -
                             (s0 - epi_surrogate(c, t, x0 - 2 * h2, x0)) / (2 * h2);
      const bool kink = std::fabs(j1 - (h / h2) * j2) >
                        1e-6L * (1e-3L + std::fabs(d_c)) +
                            1e3L * std::numeric_limits<long double>::epsilon() *
                                (1 + std::fabs(s0)) / h2;
      // the size of the terms: rho up to e^20 on clamped tokens, |A|, |logp| (cispo), the KL
      const long double old_v = c.has_old ? t.old : x0;
      const long double rho = std::exp(ld_clamp(x0 - old_v, 20.0L));
      const long double dref = x0 - t.ref;
      const long double mag_pg = t.isw * (1 + rho) * std::fabs(t.adv) * (1 + std::fabs(x0)) * 4 +
                                 c.ent_coef * std::fabs(H);
      const long double mag_kl = c.kl_coef * (1 + rho) *
                                 (1 + std::fabs(dref) + dref * dref +
                                  std::exp(ld_min(20.0L, std::fabs(dref))));
      const double tol = rt * (double)mag_pg + rt_kl * (double)mag_kl;
      bool ok = close((double)o_loss[i], want_loss, 0.0, tol);
      const long double gs = c.grad_scale;
      const long double want_dent = -gs * (c.has_went ? (long double)went[i] : (long double)w[i]) *
                                    c.ent_coef;
      ok &= close((double)g.dent, want_dent, rt, 0.0);
      if (kink) {
        ++kinks;
      } else {
        const long double want_dlogp = gs * (long double)w[i] * d_c;
        ok &= close((double)g.dlogp, want_dlogp, 0.0, (double)(gs * w[i]) * tol + 1e-30);
        // the token's own dlogit entry from the epilogue's dlogp and dent
        const long double p = std::exp(x0);
        const long double gt = (-(long double)g.dlogp * std::expm1(x0) -
                                p * (long double)g.dent * (x0 + H)) * (long double)tp.inv;
        ok &= close((double)g.g_tok, gt, 0.0,
                    rt * (double)((std::fabs((long double)g.dlogp) + std::fabs((long double)g.dent) *
                                  (std::fabs(x0) + std::fabs(H))) * tp.inv) + 1e-30);
        ++checked;
      }
      if (!ok && bad < 3)
        std::printf("  [%s %s i=%lld] loss %.10g vs %.10Lg, dlogp %.10g vs %.10Lg, dent %.6g vs "
                    "%.6Lg (logp %.6Lg old %.6Lg rho %.6Lg A %.4Lg)\n",
                    c.label, name<T>(), (long long)i, (double)o_loss[i], want_loss,
                    (double)g.dlogp, gs * (long double)w[i] * d_c, (double)g.dent, want_dent, x0,
                    old_v, rho, t.adv);
      bad += !ok;
    }
    EXPECT(bad == 0, "[epilogue %s %s] %d of %lld tokens off the long-double formula\n", c.label,
           name<T>(), bad, (long long)n);
  }
  std::printf("%-8s %d epilogue tokens checked (%zu configurations, %d at a kink: value only)\n",
              name<T>(), checked, sizeof(cfgs) / sizeof(cfgs[0]), kinks);
}

// ---------------------------------------------------------------- scale_grad_ and plans

template <typename T>
static void scale_cases() {
  using A = acc_of<T>;
  constexpr int N = Pack<T>::N;
  std::mt19937 rng(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t V : {int64_t(1), int64_t(9), int64_t(4099)})
    for (int sh = 0; sh < N; ++sh) {
      RowBuf<T> b(V, sh);
      std::vector<T> x(V);
      for (int64_t v = 0; v < V; ++v) b.p[v] = x[v] = static_cast<T>(nd(rng));
      const A f = static_cast<A>(1.0 / 3.0);
      arm_loads(b.p, V);
      for (int tid = 0; tid < 96; ++tid) scale_range(b.p, 0, V, V, f, tid, 96);
      disarm_loads();
      int bad = 0;
      for (int64_t v = 0; v < V; ++v)
        bad += !same_bits(b.p[v], static_cast<T>(static_cast<A>(x[v]) * f));
      EXPECT(bad == 0, "[scale %s V=%lld sh=%d] %d entries\n", name<T>(), (long long)V, sh, bad);
    }
}

template <typename T>
static void plan_cases() {
  constexpr int64_t N = Pack<T>::N;
  for (int64_t V = 1; V < 3000000; V = V * 3 + 1) {
    const ChunkPlan p = chunk_plan<T>(V);
    EXPECT(p.chunk % N == 0 && p.S >= 1 && p.S <= kMaxChunks && (p.S - 1) * p.chunk < V &&
               p.S * p.chunk >= V && p.threads % kWarpSize == 0 && p.threads <= kChunkThreads,
           "[plan %s V=%lld] threads %d chunk %lld S %lld\n", name<T>(), (long long)V, p.threads,
           (long long)p.chunk, (long long)p.S);
  }
}

// The per-row temperature (row_reduce.cuh row_temp): row i's Temp from per_row[i] must be
// the scalar's (temp_of, launch.h make_temp's formulas) bit for bit, the capped base-2
// scale included; without per_row the scalar Temp itself.
template <typename A>
static void row_temp_cases() {
  const std::vector<double> ts = {1.0, 0.7, 1.3, 1e-3, 1e-10, 3e-38, 2.5e-39, 1e30, 0.625};
  std::vector<A> per_row;
  for (double t : ts) per_row.push_back(static_cast<A>(t));
  Temp<A> tp{static_cast<A>(0.5), static_cast<A>(0.25)};
  tp.per_row = per_row.data();
  for (size_t i = 0; i < ts.size(); ++i) {
    const double t = static_cast<double>(per_row[i]);  // the value the kernel reads
    if (!(std::isfinite(1.0 / t) && 1.0 / t <= (double)std::numeric_limits<A>::max()))
      continue;  // rejected before any kernel (ppo_kernels/_checks.py)
    const Temp<A> want = temp_of<typename std::conditional<sizeof(A) == 8, double,
                                                           float>::type>(t);
    const Temp<A> got = row_temp(tp, static_cast<int64_t>(i));
    EXPECT(std::memcmp(&got.inv, &want.inv, sizeof(A)) == 0 &&
               std::memcmp(&got.inv2, &want.inv2, sizeof(A)) == 0,
           "row_temp(%g): inv %a / %a, inv2 %a / %a\n", t, (double)got.inv, (double)want.inv,
           (double)got.inv2, (double)want.inv2);
  }
  Temp<A> plain{static_cast<A>(0.5), static_cast<A>(0.25)};
  const Temp<A> same = row_temp(plain, 3);
  EXPECT(same.inv == plain.inv && same.inv2 == plain.inv2, "row_temp without per_row\n");
  std::printf("%-8s row_temp of %zu temperatures (%s)\n", "temps", ts.size(),
              sizeof(A) == 8 ? "double" : "float");
}

int main() {
  std::mt19937 rng(1234);
  row_temp_cases<float>();
  row_temp_cases<double>();
  random_rows<float>(rng);
  random_rows<c10::BFloat16>(rng);
  random_rows<c10::Half>(rng);
  random_rows<double>(rng);
  confident_rows<float>();
  confident_rows<double>();
  finfo_min_rows<float>();
  finfo_min_rows<c10::BFloat16>();
  finfo_min_rows<c10::Half>();
  special_cases();
  extreme_cases();
  epilogue_cases<float>(rng);
  epilogue_cases<c10::BFloat16>(rng);
  epilogue_cases<double>(rng);
  scale_cases<float>();
  scale_cases<c10::BFloat16>();
  scale_cases<c10::Half>();
  scale_cases<double>();
  plan_cases<float>();
  plan_cases<c10::BFloat16>();
  plan_cases<double>();
  std::printf("%-8s %ld 16-byte block loads checked to lie inside their row\n", "loads",
              g_checked_loads);
  EXPECT(g_checked_loads > 0 && g_bad_loads == 0, "%ld 16-byte loads outside the row\n",
         g_bad_loads);
  std::printf(g_fail ? "FAILED: %d\n" : "all passed\n", g_fail);
  return g_fail ? 1 : 0;
}
