// Host emulation of the per-thread pieces of the CUDA row kernels (row_reduce.cuh), for
// machines without a GPU: every "thread" tid of a block of nthr runs range_stats /
// grad_range / zero_range in turn on the CPU, exactly the code the kernels run, and the
// results are merged and checked against a long-double reference. Covers the head / 16-byte
// body / tail split at every misalignment, the split-vocabulary chunks, the backwards
// gradient sweep (every element written exactly once, in place too), -inf entries, the
// token one-hot, and the zero sweep. It does not cover the warp shuffles and barriers
// (block_merge and friends), which only a GPU run checks.
//
// Build and run (not part of setup.py; csrc/cuda/*.cu does not glob this folder):
//   TI=$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
//   nvcc -std=c++20 -O1 --expt-relaxed-constexpr -I csrc -I $TI \
//        csrc/cuda/host_check/emulate_rows.cu -o /tmp/emu
//   /tmp/emu
#include <cmath>
#include <cstdio>
#include <cstring>
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

// Reference lse / entropy of z = x * inv_temp over [begin, end), long double.
static void ref_stats(const std::vector<double>& z, int64_t begin, int64_t end,
                      long double& lse, long double& ent) {
  long double m = -INFINITY;
  for (int64_t v = begin; v < end; ++v) m = std::max<long double>(m, z[v]);
  long double s = 0, t = 0;
  for (int64_t v = begin; v < end; ++v) {
    if (std::isinf(z[v])) continue;
    const long double e = std::exp((long double)z[v] - m);
    s += e;
    t += e * ((long double)z[v] - m);
  }
  lse = m + std::log(s);
  ent = std::log(s) - t / s;
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
  std::vector<double> z(V);
  const double temp = 0.7;
  const A inv_temp = static_cast<A>(1.0 / temp);
  for (int64_t v = 0; v < V; ++v) in[v] = static_cast<T>(nd(rng));
  for (int k = 0; k < n_ninf && V > 1; ++k) in[rng() % V] = static_cast<T>(-INFINITY);
  for (int64_t v = 0; v < V; ++v) z[v] = static_cast<double>(static_cast<A>(in[v]) * inv_temp);
  // the token: any finite entry
  int64_t tok = rng() % V;
  while (std::isinf(z[tok])) tok = (tok + 1) % V;

  // statistics: S chunks (the split kernels) or one range (the fused kernel)
  const int64_t chunk = S > 1 ? (V + S - 1) / S : V;
  Stats<A> all = stats_empty<A>();
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t c1 = std::min(V, c0 + chunk);
    Stats<A> part = stats_empty<A>();
    for (int tid = nthr - 1; tid >= 0; --tid)  // merge order differs from the GPU's: fine
      stats_merge(part, range_stats(in, c0, c1, inv_temp, tid, nthr));
    long double rl, re;
    ref_stats(z, c0, c1, rl, re);
    A pl, pe;
    stats_finish(part, pl, pe);
    EXPECT(std::fabs((double)(pl - rl)) < tol<T>() * (1 + std::fabs((double)rl)) &&
               std::fabs((double)(pe - re)) < tol<T>() * (1 + std::fabs((double)re)),
           "[%s V=%lld sh=%d nthr=%d S=%lld] chunk %lld: lse %g vs %g, H %g vs %g\n", name<T>(),
           (long long)V, shift_in, nthr, (long long)S, (long long)c0, (double)pl, (double)rl,
           (double)pe, (double)re);
    stats_merge(all, part);
  }
  long double rlse, rent;
  ref_stats(z, 0, V, rlse, rent);
  A lse, ent;
  stats_finish(all, lse, ent);
  EXPECT(std::fabs((double)(lse - rlse)) < tol<T>() * (1 + std::fabs((double)rlse)) &&
             std::fabs((double)(ent - rent)) < tol<T>() * (1 + std::fabs((double)rent)),
         "[%s V=%lld sh=%d nthr=%d] lse %.9g vs %.9Lg, H %.9g vs %.9Lg\n", name<T>(),
         (long long)V, shift_in, nthr, (double)lse, rlse, (double)ent, rent);

  // gradient: poison the output, run every thread's backwards sweep over every chunk
  const A dlogp = static_cast<A>(0.37), dent = static_cast<A>(-0.11);
  std::vector<double> expect(V);
  for (int64_t v = 0; v < V; ++v)
    expect[v] = static_cast<double>(static_cast<T>(
        ppo::dlogit<A>(static_cast<A>(z[v]), lse, ent, dlogp, dent, inv_temp, v == tok)));
  if (!inplace)
    for (int64_t v = 0; v < V; ++v) out[v] = static_cast<T>(NAN);
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t c1 = std::min(V, c0 + chunk);
    for (int tid = 0; tid < nthr; ++tid)
      grad_range(in, out, c0, c1, tok, lse, ent, dlogp, dent, inv_temp, tid, nthr);
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
    if (std::isinf(z[v])) {
      EXPECT(static_cast<double>(out[v]) == 0.0, "[%s] -inf entry gets %g\n", name<T>(),
             static_cast<double>(out[v]));
      continue;
    }
    const long double lp = (long double)z[v] - rlse;
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

// A row whose entries are all -inf but one, and an all -inf chunk in a split row.
void special_cases() {
  std::vector<Pack<float>> buf(64);
  float* x = reinterpret_cast<float*>(buf.data()) + 1;
  for (int v = 0; v < 200; ++v) x[v] = -INFINITY;
  x[150] = 2.5f;
  Stats<float> st = stats_empty<float>();
  for (int tid = 0; tid < 32; ++tid) stats_merge(st, range_stats(x, 0, 200, 1.0f, tid, 32));
  float lse, ent;
  stats_finish(st, lse, ent);
  EXPECT(std::fabs(lse - 2.5f) < 1e-6f && std::fabs(ent) < 1e-6f,
         "one finite entry: lse %g H %g\n", lse, ent);
  // a NaN logit must not vanish
  x[10] = NAN;
  st = stats_empty<float>();
  for (int tid = 0; tid < 32; ++tid) stats_merge(st, range_stats(x, 0, 200, 1.0f, tid, 32));
  stats_finish(st, lse, ent);
  EXPECT(std::isnan(lse), "NaN logit dropped: lse %g\n", lse);
}

int main() {
  std::mt19937 rng(1234);
  run_type<float>(rng);
  run_type<c10::BFloat16>(rng);
  run_type<c10::Half>(rng);
  run_type<double>(rng);
  special_cases();
  std::printf(g_fail ? "FAILED: %d\n" : "all passed\n", g_fail);
  return g_fail ? 1 : 0;
}
