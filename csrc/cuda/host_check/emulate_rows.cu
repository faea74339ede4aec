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
//    to ~1e-6 relative; a leading chunk at finfo.min (review C1), at temperature 1 and 0.7;
//  - extreme logits (fp16/bf16 max, float 3e38, temperature 1e-10), NaN stays loud, all -inf
//    rows give NaN; scale_range (scale_grad_) rounds x * f once, at every phase.
// Not covered: real shuffles/barriers/launches (gpu_check.sh on a GPU), and the device's
// own libm: exp2f is 2 ulp on the device vs < 1 ulp in glibc (NOTES.md, tolerances).
//
// Build and run (tests/test_cuda_host_emulation.py does this):
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
                   token_grad(r.logp, r.rs.entropy, dlogp, dent, tp.inv), tok};
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
                                              r.g.entropy, r.g.dlogp, r.g.dent, tp.inv, tp.inv2);
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
  int cases = 0;
  for (int64_t V : Vs) {
    std::normal_distribution<double> nd(0.0, 3.0);
    std::vector<double> xs(V);
    for (auto& v : xs) v = static_cast<double>(static_cast<T>(nd(rng)));
    if (V > 8)
      for (int k = 0; k < 3; ++k) xs[rng() % V] = -INFINITY;
    int64_t tok = rng() % V;
    while (std::isinf(xs[tok])) tok = (tok + 1) % V;
    const Temp<A> tp = temp_of<T>(0.7);
    const A dlogp = static_cast<A>(0.37), dent = static_cast<A>(-0.11);
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
// rebases from a max near -3.4e38, where dm * s overflows (review C1). Must stay finite.
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
  {  // temperature 1e-10 and 1e-3: the max entry must give d = 0 exactly (review C4)
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

int main() {
  std::mt19937 rng(1234);
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
