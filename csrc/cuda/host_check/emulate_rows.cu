// Host emulation of the per-thread pieces of the CUDA row kernels (row_reduce.cuh), for
// machines without a GPU: every "thread" tid of a block of nthr runs range_stats /
// grad_range / zero_range in turn on the CPU, exactly the code the kernels run, and the
// results are merged and checked against a long-double reference. Covers the head / 16-byte
// body / tail split at every misalignment, the split-vocabulary chunks, the backwards
// gradient sweep (every element written exactly once, in place too), -inf entries, the
// token one-hot, the zero sweep, the token's logprob, and rows of extreme logits (fp16 and
// bf16 values at their largest finite magnitude, float 3e38, temperature 1e-10) where the
// shifted difference (x - xmax) / temperature must keep logp exact. It does not cover the warp shuffles and barriers
// (block_merge and friends), which only a GPU run checks.
//
// Build and run (not part of setup.py; csrc/cuda/*.cu does not glob this folder):
//   TI=$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
//   nvcc -std=c++20 -O1 --expt-relaxed-constexpr -I csrc -I $TI \
//        csrc/cuda/host_check/emulate_rows.cu -o /tmp/emu
//   /tmp/emu
// To let the host compiler contract a * b + c into FMAs as nvcc does on the device, add
// -Xcompiler -mfma,-ffp-contract=fast (passes). Above -O1 also add -fno-strict-aliasing:
// the host fallback of the 16-byte pack loads/stores type-puns through Pack<T>, which
// gcc's strict aliasing at -O2 miscompiles (host emulation only; the device path differs).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <limits>
#include <random>
#include <vector>

#include "../row_reduce.cuh"

using namespace ppo_cuda;

static int g_fail = 0;
#define EXPECT(cond, ...)                      \
  do {                                         \
    if (!(cond)) {                             \
      if (g_fail < 20) std::printf(__VA_ARGS__); \
      ++g_fail;                                \
    }                                          \
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

template <typename T>
double tol() { return sizeof(T) == 8 ? 1e-12 : 2e-5; }

// Reference statistics of z = x * inv_temp over [begin, end) in long double (x: the raw
// logits as the kernels read them, inv_temp: the accumulation-dtype value they use; the
// product is exact in long double for float operands). zmax and log s are returned too so
// that logp = (z_tok - zmax) - log s loses nothing to the size of lse.
struct Ref {
  long double zmax, log_s, lse, ent;
};
static Ref ref_stats(const std::vector<double>& x, long double inv_temp, int64_t begin,
                     int64_t end) {
  long double m = -INFINITY;
  for (int64_t v = begin; v < end; ++v) m = std::max<long double>(m, x[v] * inv_temp);
  long double s = 0, t = 0;
  for (int64_t v = begin; v < end; ++v) {
    if (std::isinf(x[v])) continue;
    const long double d = (long double)x[v] * inv_temp - m;
    const long double e = std::exp(d);
    s += e;
    t += e * d;
  }
  Ref r;
  r.zmax = m;
  r.log_s = std::log(s);
  r.lse = m + r.log_s;
  r.ent = r.log_s - t / s;
  return r;
}
static long double ref_logp(const Ref& r, double x_tok, long double inv_temp) {
  return ((long double)x_tok * inv_temp - r.zmax) - r.log_s;
}
static bool close(double got, long double want, double rtol, double atol) {
  if (std::isnan(got) || std::isnan((double)want)) return false;
  if (std::isinf(got) || std::isinf((double)want)) return got == (double)want;
  return std::fabs((long double)got - want) <= atol + rtol * std::fabs(want);
}

template <typename T>
void check_row(int64_t V, int shift_in, int shift_out, int nthr, int64_t S, bool inplace,
               std::mt19937& rng, int n_ninf) {
  using A = acc_of<T>;
  constexpr int N = Pack<T>::N;
  // 16-byte aligned buffers, then shifted by `shift` elements to misalign the row
  std::vector<Pack<T>> in_buf((V + 2 * N) / N + 2), out_buf((V + 2 * N) / N + 2);
  T* in = reinterpret_cast<T*>(in_buf.data()) + shift_in;
  T* out = inplace ? in : reinterpret_cast<T*>(out_buf.data()) + shift_out;
  std::normal_distribution<double> nd(0.0, 3.0);
  std::vector<double> x(V);
  const double temp = 0.7;
  const A inv_temp = static_cast<A>(1.0 / temp);
  const long double inv_ld = static_cast<long double>(inv_temp);
  for (int64_t v = 0; v < V; ++v) in[v] = static_cast<T>(nd(rng));
  for (int k = 0; k < n_ninf && V > 1; ++k) in[rng() % V] = static_cast<T>(-INFINITY);
  for (int64_t v = 0; v < V; ++v) x[v] = static_cast<double>(static_cast<A>(in[v]));
  // the token: any finite entry
  int64_t tok = rng() % V;
  while (std::isinf(x[tok])) tok = (tok + 1) % V;

  // statistics: S chunks (the split kernels) or one range (the fused kernel)
  const int64_t chunk = S > 1 ? (V + S - 1) / S : V;
  Stats<A> all = stats_empty<A>();
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t c1 = std::min(V, c0 + chunk);
    Stats<A> part = stats_empty<A>();
    for (int tid = nthr - 1; tid >= 0; --tid)  // merge order differs from the GPU's: fine
      stats_merge(part, range_stats(in, c0, c1, inv_temp, tid, nthr), inv_temp);
    const Ref rc = ref_stats(x, inv_ld, c0, c1);
    const long double rl = rc.lse, re = rc.ent;
    const RowStats<A> prs = stats_finish(part, inv_temp);
    const A pl = prs.lse, pe = prs.entropy;
    EXPECT(std::fabs((double)(pl - rl)) < tol<T>() * (1 + std::fabs((double)rl)) &&
               std::fabs((double)(pe - re)) < tol<T>() * (1 + std::fabs((double)re)),
           "[%s V=%lld sh=%d nthr=%d S=%lld] chunk %lld: lse %g vs %g, H %g vs %g\n", name<T>(),
           (long long)V, shift_in, nthr, (long long)S, (long long)c0, (double)pl, (double)rl,
           (double)pe, (double)re);
    stats_merge(all, part, inv_temp);
  }
  const Ref rr = ref_stats(x, inv_ld, 0, V);
  const long double rlse = rr.lse, rent = rr.ent;
  const RowStats<A> rs = stats_finish(all, inv_temp);
  const A lse = rs.lse, ent = rs.entropy;
  EXPECT(std::fabs((double)(lse - rlse)) < tol<T>() * (1 + std::fabs((double)rlse)) &&
             std::fabs((double)(ent - rent)) < tol<T>() * (1 + std::fabs((double)rent)),
         "[%s V=%lld sh=%d nthr=%d] lse %.9g vs %.9Lg, H %.9g vs %.9Lg\n", name<T>(),
         (long long)V, shift_in, nthr, (double)lse, rlse, (double)ent, rent);
  const A logp = token_logp(rs, static_cast<A>(in[tok]), inv_temp);
  const long double rlogp = ref_logp(rr, x[tok], inv_ld);
  EXPECT(close((double)logp, rlogp, tol<T>(), tol<T>()),
         "[%s V=%lld sh=%d nthr=%d S=%lld] logp %.9g vs %.9Lg\n", name<T>(), (long long)V,
         shift_in, nthr, (long long)S, (double)logp, rlogp);

  // gradient: poison the output, run every thread's backwards sweep over every chunk
  const A dlogp = static_cast<A>(0.37), dent = static_cast<A>(-0.11);
  std::vector<double> expect(V);
  for (int64_t v = 0; v < V; ++v)
    expect[v] = static_cast<double>(static_cast<T>(ppo::dlogit<A>(
        (static_cast<A>(in[v]) - rs.xmax) * inv_temp, rs.log_s, ent, dlogp, dent, inv_temp,
        v == tok)));
  if (!inplace)
    for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t c1 = std::min(V, c0 + chunk);
    for (int tid = 0; tid < nthr; ++tid)
      grad_range(in, out, c0, c1, tok, rs.xmax, rs.log_s, ent, dlogp, dent, inv_temp, tid,
                 nthr);
  }
  int bad = 0;
  double gsum = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double g = static_cast<double>(out[v]);
    gsum += g;
    if (!(g == expect[v])) ++bad;  // same code, same rounding: bit-equal (NaN fails)
  }
  EXPECT(bad == 0, "[%s V=%lld sh=%d/%d nthr=%d S=%lld inplace=%d] %d gradient entries wrong\n",
         name<T>(), (long long)V, shift_in, shift_out, nthr, (long long)S, inplace, bad);
  // with dent = 0 the row gradient sums to 0 (sum p = 1); here check the exact formula
  // against the analytic one in long double, which validates dlogit's use as well
  double max_err = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (std::isinf(x[v])) {
      EXPECT(static_cast<double>(out[v]) == 0.0, "[%s] -inf entry gets %g\n", name<T>(),
             static_cast<double>(out[v]));
      continue;
    }
    const long double lp = ((long double)x[v] * inv_ld - rr.zmax) - rr.log_s;
    const long double p = std::exp(lp);
    const long double g =
        ((v == tok ? (long double)dlogp : 0.0L) - p * ((long double)dlogp + (long double)dent * (lp + rent))) /
        (long double)temp;
    max_err = std::max(max_err, (double)std::fabs((double)(g - (long double)static_cast<double>(out[v]))));
  }
  const double gtol = sizeof(T) == 2 ? 4e-3 : (sizeof(T) == 4 ? 1e-5 : 1e-12);
  EXPECT(max_err < gtol, "[%s V=%lld] gradient max error %g\n", name<T>(), (long long)V, max_err);
  (void)gsum;

  // zero sweep writes every entry
  for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t c1 = std::min(V, c0 + chunk);
    for (int tid = 0; tid < nthr; ++tid) zero_range(out, c0, c1, tid, nthr);
  }
  bad = 0;
  for (int64_t v = 0; v < V; ++v) bad += !(static_cast<double>(out[v]) == 0.0);
  EXPECT(bad == 0, "[%s V=%lld sh=%d] zero sweep left %d entries\n", name<T>(), (long long)V,
         shift_out, bad);
}

template <typename T>
void run_type(std::mt19937& rng) {
  constexpr int N = Pack<T>::N;
  const int64_t Vs[] = {1, 2, 7, 13, 64, 1000, 4099, 32003};
  const int threads[] = {32, 96, 256};
  int cases = 0;
  for (int64_t V : Vs)
    for (int si = 0; si < N; ++si)
      for (int nthr : threads)
        for (int64_t S : {int64_t(1), int64_t(3)})
          for (int inplace = 0; inplace < 2; ++inplace) {
            const int so = inplace ? si : (si * 3 + 1) % N;  // a different phase sometimes
            check_row<T>(V, si, so, nthr, S, inplace, rng, V > 8 ? 3 : 0);
            check_row<T>(V, si, si, nthr, S, inplace, rng, 0);
            cases += 2;
          }
  std::printf("%-6s %d cases\n", name<T>(), cases);
}

// A row of extreme logits (given as doubles, stored as T) with token tok at temperature temp:
// logp, lse, entropy and the gradient against the long-double reference, through every
// thread split, both phases and the split-vocabulary merge. Here the shifted difference
// (x - xmax) / temperature matters: logp = z_tok - lse loses ~4e-4 at fp16's 65504 and all
// of it at 3e38 (lse rounds to z_tok), and at temperature 1e-10 x * inv_temp - m contracted
// into an FMA leaves a residue of ~1e3 on the max entry (exp: +inf).
template <typename T>
void check_extreme(const char* label, const std::vector<double>& xs, int64_t tok, double temp) {
  using A = acc_of<T>;
  constexpr int N = Pack<T>::N;
  const int64_t V = static_cast<int64_t>(xs.size());
  const A inv_temp = static_cast<A>(1.0 / temp);
  const long double inv_ld = static_cast<long double>(inv_temp);
  std::vector<Pack<T>> in_buf(V / N + 3), out_buf(V / N + 3);
  for (int shift : {0, 1}) {
    T* in = reinterpret_cast<T*>(in_buf.data()) + shift;
    T* out = reinterpret_cast<T*>(out_buf.data()) + shift;
    std::vector<double> x(V);
    for (int64_t v = 0; v < V; ++v) {
      in[v] = static_cast<T>(xs[v]);
      x[v] = static_cast<double>(static_cast<A>(in[v]));
    }
    const Ref rr = ref_stats(x, inv_ld, 0, V);
    const long double rlogp = ref_logp(rr, x[tok], inv_ld);
    for (int nthr : {1, 32, 96})
      for (int64_t S : {int64_t(1), int64_t(3)}) {
        const int64_t chunk = S > 1 ? (V + S - 1) / S : V;
        Stats<A> all = stats_empty<A>();
        for (int64_t c0 = 0; c0 < V; c0 += chunk) {
          const int64_t c1 = std::min(V, c0 + chunk);
          Stats<A> part = stats_empty<A>();
          for (int tid = 0; tid < nthr; ++tid)
            stats_merge(part, range_stats(in, c0, c1, inv_temp, tid, nthr), inv_temp);
          stats_merge(all, part, inv_temp);
        }
        const RowStats<A> rs = stats_finish(all, inv_temp);
        const A logp = token_logp(rs, static_cast<A>(in[tok]), inv_temp);
        const double rt = sizeof(A) == 8 ? 1e-13 : 2e-6;
        EXPECT(close((double)logp, rlogp, rt, rt) && close((double)rs.entropy, rr.ent, rt, 1e-5) &&
                   close((double)rs.lse, rr.lse, rt, rt),
               "[%s %s sh=%d nthr=%d S=%lld] logp %.9g vs %.9Lg, H %.9g vs %.9Lg, "
               "lse %.9g vs %.9Lg\n",
               label, name<T>(), shift, nthr, (long long)S, (double)logp, rlogp,
               (double)rs.entropy, rr.ent, (double)rs.lse, rr.lse);
        // gradient with entropy and logp terms, against the analytic one in long double
        // (rounded to T: an entry whose true value overflows T must come back as that inf)
        const A dlogp = static_cast<A>(0.37), dent = static_cast<A>(-0.11);
        for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
        for (int64_t c0 = 0; c0 < V; c0 += chunk) {
          const int64_t c1 = std::min(V, c0 + chunk);
          for (int tid = 0; tid < nthr; ++tid)
            grad_range(in, out, c0, c1, tok, rs.xmax, rs.log_s, rs.entropy, dlogp, dent,
                       inv_temp, tid, nthr);
        }
        int bad = 0;
        double worst_got = 0, worst_want = 0;
        for (int64_t v = 0; v < V; ++v) {
          long double g = 0;
          if (!std::isinf(x[v])) {
            const long double lp = ((long double)x[v] * inv_ld - rr.zmax) - rr.log_s;
            const long double p = std::exp(lp);
            g = ((v == tok ? (long double)dlogp : 0.0L) -
                 (p == 0 ? 0.0L : p * ((long double)dlogp + (long double)dent * (lp + rr.ent)))) *
                inv_ld;
          }
          const double want = static_cast<double>(static_cast<T>(static_cast<double>(g)));
          const double got = static_cast<double>(out[v]);
          // T's rounding, plus float's relative error on p amplified by 1 / temperature
          const double gt = (sizeof(T) == 2 ? 1e-2 : (sizeof(T) == 4 ? 1e-5 : 1e-12)) *
                            (std::fabs(want) + 1e-6 * (double)inv_ld);
          if (!close(got, want, 0.0, gt)) {
            if (!bad) worst_got = got, worst_want = want;
            ++bad;
          }
        }
        EXPECT(bad == 0, "[%s %s sh=%d nthr=%d S=%lld] %d gradient entries wrong, e.g. %g vs %g\n",
               label, name<T>(), shift, nthr, (long long)S, bad, worst_got, worst_want);
      }
  }
}

void extreme_cases() {
  std::mt19937 rng(99);
  int cases = 0;
  // fp16 at +-65504: three entries at the max (the token one of them), a few just below it
  // (fp16 spacing there is 32), the rest at -65504; at temperature 1 and 0.7; the token
  // also one step below the max.
  {
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
    // the max entries first in the row, -65504 last: the rescale runs the other way
    std::reverse(xs.begin(), xs.end());
    check_extreme<c10::Half>("fp16 65504 reversed", xs, V - 1 - 517, 1.0);
    ++cases;
  }
  // bf16 at its largest finite magnitude (3.39e38) and float at 3e38: four entries at the
  // max, token among them: logp = -log 4 (lse = z_tok + 1.386 rounds to z_tok in float).
  // x - xmax = -6.8e38 overflows to -inf there: p = 0, no NaN in s, t or the gradient.
  {
    const double bmax = static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    const int64_t V = 300;
    std::vector<double> xs(V, -bmax);
    xs[100] = xs[101] = xs[250] = xs[299] = bmax;
    check_extreme<c10::BFloat16>("bf16 max", xs, 250, 1.0);
    check_extreme<c10::BFloat16>("bf16 max, T=2", xs, 250, 2.0);
    std::vector<double> xf(V, -3e38);
    xf[3] = xf[150] = xf[151] = xf[290] = 3e38;
    check_extreme<float>("float 3e38", xf, 150, 1.0);
    xf[7] = 3e38 * 0.999999;  // z = 3e38 - 3e32: p = 0 beside the max
    check_extreme<float>("float 3e38 + near", xf, 7, 1.0);
    cases += 4;
  }
  // temperature 1e-10 with modest logits (sd 3): the max entry must give d = 0 exactly (p = 1
  // for a unique max, never +inf or NaN), the others p = 0; token at the max, below it, and
  // at one of two tied maxima (logp = -log 2, H = log 2).
  {
    const int64_t V = 1000;
    std::normal_distribution<double> nd(0.0, 3.0);
    std::vector<double> xs(V);
    for (auto& v : xs) v = std::max(-11.0, std::min(11.0, nd(rng)));
    xs[321] = 12.0;
    auto run = [&](const char* label, int64_t tok) {
      check_extreme<float>(label, xs, tok, 1e-10);
      check_extreme<c10::BFloat16>(label, xs, tok, 1e-10);
      check_extreme<c10::Half>(label, xs, tok, 1e-10);
      check_extreme<double>(label, xs, tok, 1e-10);
      cases += 4;
    };
    run("T=1e-10, token at max", 321);
    run("T=1e-10, token below max", 10);
    xs[654] = 12.0;
    run("T=1e-10, two tied maxima", 654);
  }
  std::printf("%-6s %d cases\n", "extreme", cases);
}

// A row whose entries are all -inf but one, and an all -inf chunk in a split row.
void special_cases() {
  std::vector<Pack<float>> buf(64);
  float* x = reinterpret_cast<float*>(buf.data()) + 1;
  for (int v = 0; v < 200; ++v) x[v] = -INFINITY;
  x[150] = 2.5f;
  Stats<float> st = stats_empty<float>();
  for (int tid = 0; tid < 32; ++tid)
    stats_merge(st, range_stats(x, 0, 200, 1.0f, tid, 32), 1.0f);
  RowStats<float> rs = stats_finish(st, 1.0f);
  float lse = rs.lse, ent = rs.entropy;
  EXPECT(std::fabs(lse - 2.5f) < 1e-6f && std::fabs(ent) < 1e-6f,
         "one finite entry: lse %g H %g\n", lse, ent);
  // a NaN logit must not vanish
  x[10] = NAN;
  st = stats_empty<float>();
  for (int tid = 0; tid < 32; ++tid)
    stats_merge(st, range_stats(x, 0, 200, 1.0f, tid, 32), 1.0f);
  rs = stats_finish(st, 1.0f);
  lse = rs.lse;
  EXPECT(std::isnan(lse), "NaN logit dropped: lse %g\n", lse);
}

int main() {
  std::mt19937 rng(1234);
  run_type<float>(rng);
  run_type<c10::BFloat16>(rng);
  run_type<c10::Half>(rng);
  run_type<double>(rng);
  special_cases();
  extreme_cases();
  std::printf(g_fail ? "FAILED: %d\n" : "all passed\n", g_fail);
  return g_fail ? 1 : 0;
}
