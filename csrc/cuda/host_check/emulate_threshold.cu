// Host emulation of the device threshold select (threshold_select.cuh) and of the kept
// statistics on its threshold (kept_stats, each row with a token drawn from it): the block
// program itself, run with a host block policy (each step's threads one after another, a barrier
// between steps), on bfloat16 and float16 rows, against the CPU op's rules written plainly
// here (csrc/cpu/sampling.cpp row_threshold: a sort, the survivors' masses summed group by
// group in double). Rows: random logits at several scales, integer logits (ties, ties at the
// boundary), one sign only, flat rows whose top-p boundary lies among the negatives (the
// third sweep), -inf / +inf / NaN / +-0 entries, a value repeated more than 65,535 times,
// every combination of top_k / top_p / min_p, several temperatures, every address phase of
// a 16-byte pack, and short rows thick with special entries at temperatures far from 1.
// A top-p threshold may differ from the reference only where the target mass lies within
// 1e-12 of a group's cumulative mass (the sums' order differs).
//
//   nvcc -std=c++20 -O1 --expt-relaxed-constexpr -I csrc \
//     csrc/cuda/host_check/emulate_threshold.cu -o /tmp/emu_thr && /tmp/emu_thr
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "../threshold_select.cuh"

using namespace ppo_cuda::select;

struct HostBlock {
  template <class F>
  PPO_SEL_HD void each(F&& f) {
    for (int t = 0; t < kThreads; ++t) f(t);
  }
  template <class F>
  PPO_SEL_HD void one(F&& f) {
    f();
  }
  PPO_SEL_HD static void add(uint32_t* p, uint32_t v) { *p += v; }
};

static int g_fail = 0, g_rows = 0, g_boundary = 0, g_kept = 0, g_kept_bins = 0;

// bits of the 16-bit float nearest to v (round to nearest even), for both formats
static uint16_t to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
static uint16_t to_half(float v) {
  // through the exact values: the nearest of the 65,536 (ties to even mantissa)
  static std::vector<std::pair<double, uint16_t>> table;
  if (table.empty()) {
    for (uint32_t b = 0; b < 0x10000u; ++b)
      if (!HalfBits::is_nan(uint16_t(b))) table.push_back({HalfBits::value(uint16_t(b)), uint16_t(b)});
    std::sort(table.begin(), table.end());
  }
  auto it = std::lower_bound(table.begin(), table.end(), std::make_pair(double(v), uint16_t(0)));
  if (it == table.end()) return table.back().second;
  if (it != table.begin() && std::fabs(std::prev(it)->first - v) < std::fabs(it->first - v))
    return std::prev(it)->second;
  return it->second;
}

struct Ref {
  double thr;
  bool near_boundary;  // a top-p target within 1e-12 of a group's cumulative mass
};

// The CPU op's rules, plainly (csrc/cpu/sampling.cpp row_threshold), NaN entries left out.
template <class Fmt>
static Ref reference(const std::vector<uint16_t>& row, double inv, int64_t k, double p,
                     double min_p) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> v;
  for (uint16_t b : row)
    if (!Fmt::is_nan(b)) v.push_back(Fmt::value(b));
  Ref r{-inf, false};
  if (v.empty()) return r;
  const int64_t V = static_cast<int64_t>(row.size());
  std::sort(v.begin(), v.end(), std::greater<double>());
  const double mx = v[0];
  if (!std::isfinite(mx)) return r;
  auto d = [&](double x) { return (x - mx) * inv; };
  double t = -inf;
  if (min_p > 0.0) {
    const double lo = std::log(min_p);
    double smallest = mx;
    for (double x : v)
      if (d(x) >= lo && x < smallest) smallest = x;
    t = smallest;
  }
  if (k > 0 && k < V && k < static_cast<int64_t>(v.size())) t = std::max(t, v[k - 1]);
  if (p < 1.0) {
    std::vector<double> w;
    for (double x : v)
      if (x >= t) w.push_back(x);
    long double z = 0;
    for (double x : w) z += std::exp(static_cast<long double>(d(x)));
    const long double target = p * z;
    long double above = 0;
    double last = w[0];
    size_t i = 0;
    while (i < w.size()) {
      if (std::fabs(static_cast<double>(above - target)) <= 1e-12 * static_cast<double>(z))
        r.near_boundary = true;
      if (above >= target) break;
      size_t e = i;
      long double g = 0;
      while (e < w.size() && w[e] == w[i]) g += std::exp(static_cast<long double>(d(w[e++])));
      above += g;
      last = w[i];
      i = e;
    }
    if (std::fabs(static_cast<double>(above - target)) <= 1e-12 * static_cast<double>(z))
      r.near_boundary = true;
    t = std::max(t, last);
  }
  r.thr = t;
  return r;
}

// The kept statistics of a row on threshold t and token y, plainly (csrc/cpu/sampling.cpp
// kept_logprobs_fwd: the kept max, the mass below it with the ties beyond one, sum e d, in
// long double).
template <class Fmt>
static KeptRowStats kept_reference(const std::vector<uint16_t>& row, double t, double inv,
                                   size_t y) {
  const double inf = std::numeric_limits<double>::infinity();
  const double xy = Fmt::is_nan(row[y]) ? NAN : Fmt::value(row[y]);
  std::vector<double> k;
  for (uint16_t b : row)
    if (!Fmt::is_nan(b) && Fmt::value(b) >= t) k.push_back(Fmt::value(b));
  KeptRowStats r{-inf, 0.0, 0.0, static_cast<uint32_t>(k.size()), !(xy >= t), xy};
  for (double v : k) r.top = std::max(r.top, v);
  if (r.missing) {
    if (k.empty() || xy > r.top || std::isnan(xy)) r.top = xy;
    k.push_back(xy);
    ++r.size;
  }
  long double rest = 0, sd = 0, ties = 0;
  for (double v : k) {
    if (v == r.top) {
      ties += 1;
      continue;
    }
    const long double d = (static_cast<long double>(v) - r.top) * inv, e = std::exp(d);
    rest += e;
    if (e > 0) sd += e * d;
  }
  r.rest = static_cast<double>(rest + (ties > 1 ? ties - 1 : 0));
  r.sd = static_cast<double>(sd);
  return r;
}

static bool close(double a, double b, double tol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (a == b) return true;
  return std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b));
}

// The block program on a row: its threshold, then (y < V) its kept statistics on it;
// *from_bins: whether they came from the histogram's bins (else a sweep of the row).
template <class Fmt>
static double run(const uint16_t* x, int64_t V, double inv, int64_t k, double p, double min_p,
                  int64_t y = -1, KeptRowStats* kept = nullptr, bool* from_bins = nullptr) {
  static std::unique_ptr<Smem> s(new Smem);
  // poison the shared memory: the program must not read what it did not write this row
  std::memset(s.get(), 0xA5, sizeof(Smem));
  HostBlock blk;
  double mx = NAN;
  Resident res;
  const double t = row_threshold<Fmt>(blk, *s, x, V, inv, k, p, min_p, &mx, &res);
  if (kept) {
    // (a poisoned kbins: the sweep's path must not have written it)
    std::memset(&s->kbins, 0xA5, sizeof(s->kbins));
    *kept = kept_stats<Fmt>(blk, *s, x, V, t, mx, inv, x[y], res);
    uint32_t poison;
    std::memset(&poison, 0xA5, sizeof(poison));
    *from_bins = s->kbins.count != poison;
  }
  return t;
}

template <class Fmt>
static void check(const char* what, const std::vector<uint16_t>& row, double inv, int64_t k,
                  double p, double min_p, int phase = 0) {
  ++g_rows;
  // the row at an address phase of `phase` elements past a 16-byte boundary
  std::vector<uint16_t> buf(row.size() + 16);
  uint16_t* base = buf.data();
  while (reinterpret_cast<uintptr_t>(base) % 16) ++base;
  std::copy(row.begin(), row.end(), base + phase);
  // the kept statistics on the threshold the program found, for a token drawn from the row
  // (the top entry, one below the threshold or any: kept, missing, ties at the top)
  static std::mt19937_64 pick(99);
  const size_t y = pick() % row.size();
  KeptRowStats ks;
  bool bins = false;
  const double got = run<Fmt>(base + phase, static_cast<int64_t>(row.size()), inv, k, p, min_p,
                              static_cast<int64_t>(y), &ks, &bins);
  const KeptRowStats kr = kept_reference<Fmt>(row, got, inv, y);
  // the sweep: float exps summed in float a thread, over up to 137 entries here, then in
  // double (1.1e-6 relative at most on these rows); the bins: float64 throughout, another
  // order than the reference's long double
  const double tol = bins ? 1e-12 : 1e-5;
  if (!(close(ks.top, kr.top, 0) && close(ks.xy, kr.xy, 0) && ks.size == kr.size &&
        ks.missing == kr.missing && close(ks.rest, kr.rest, tol) && close(ks.sd, kr.sd, tol))) {
    if (++g_fail <= 20)
      std::printf("FAIL kept (%s) %s: V %zu inv %.4g k %lld p %.6g min_p %.4g y %zu: top "
                  "%.9g/%.9g size %u/%u missing %d/%d rest %.17g/%.17g sd %.17g/%.17g\n",
                  bins ? "bins" : "sweep", what, row.size(), inv, static_cast<long long>(k), p,
                  min_p, y, ks.top, kr.top, ks.size, kr.size, ks.missing, kr.missing, ks.rest,
                  kr.rest, ks.sd, kr.sd);
  }
  ++g_kept;
  g_kept_bins += bins;
  const Ref ref = reference<Fmt>(row, inv, k, p, min_p);
  const bool same = got == ref.thr || (std::isnan(got) && std::isnan(ref.thr));
  if (same) return;
  if (ref.near_boundary && p < 1.0) {
    ++g_boundary;
    return;
  }
  if (++g_fail <= 20)
    std::printf("FAIL %s: V %zu inv %.4g k %lld p %.6g min_p %.4g phase %d: got %.9g want %.9g\n",
                what, row.size(), inv, static_cast<long long>(k), p, min_p, phase, got, ref.thr);
}

template <class Fmt, class To>
static void suite(const char* name, To to16, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<double> ud;
  const int64_t ks[] = {0, 1, 2, 5, 50, 1024};
  const double ps[] = {1.0, 0.5, 0.8, 0.9, 0.999};
  const double mps[] = {0.0, 0.01, 0.2};
  const double invs[] = {1.0, 1.0 / 0.7, 1.0 / 1.3, 40.0};
  for (int64_t V : {1, 2, 3, 7, 64, 1000, 4099}) {
    for (float scale : {0.3f, 2.0f, 8.0f}) {
      for (int rep = 0; rep < 6; ++rep) {
        std::vector<uint16_t> row(V);
        const float shift = rep % 3 == 0 ? 0.0f : (rep % 3 == 1 ? 20.0f : -20.0f);
        for (auto& b : row) b = to16(nd(rng) * scale + shift);  // mixed, positive, negative
        const int64_t k = ks[rng() % 6];
        const double p = ps[rng() % 5], mp = mps[rng() % 3], inv = invs[rng() % 4];
        check<Fmt>(name, row, inv, k, p, mp, static_cast<int>(rng() % 8));
        check<Fmt>(name, row, inv, k, 1.0, 0.0);
        check<Fmt>(name, row, inv, 0, p, 0.0);
        check<Fmt>(name, row, inv, 0, 1.0, mp > 0 ? mp : 0.05);
      }
    }
  }
  // integer logits: ties everywhere, and top_p at a group's exact share
  for (int64_t V : {4, 33, 500}) {
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<uint16_t> row(V);
      for (auto& b : row) b = to16(static_cast<float>(static_cast<int>(rng() % 7) - 3));
      for (int64_t k : {0, 1, 3, 10})
        for (double p : {1.0, 0.25, 0.5, 0.75, 0.9})
          for (double mp : {0.0, 0.1, 0.5}) check<Fmt>(name, row, 1.0, k, p, mp);
    }
  }
  // flat rows around 0: the boundary among the negatives (sweep 3), and one sign only
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<uint16_t> row(3000);
    for (auto& b : row) b = to16(nd(rng) * 0.05f + (rep % 2 ? 0.0f : -0.01f));
    check<Fmt>(name, row, 1.0, 0, 0.95, 0.0);
    check<Fmt>(name, row, 1.0, 2900, 0.99, 0.0);
    check<Fmt>(name, row, 1.0, 0, 0.99, 0.9);
    check<Fmt>(name, row, 1.0, 0, 0.999, 0.0, 3);
    // top_p one ulp below 1: the target at the total's rounding (every fallback of the walk)
    check<Fmt>(name, row, 1.0, 0, 1.0 - 0x1p-53, 0.0);
    for (auto& b : row) b = to16(std::fabs(Fmt::value(b)) + 1.0f);
    check<Fmt>(name, row, 1.0, 0, 1.0 - 0x1p-53, 0.0);
    check<Fmt>(name, row, 1.0, 2000, 1.0 - 0x1p-53, 0.0);
  }
  // special entries: -inf, +inf, NaN, +-0, a value repeated > 65,535 times
  {
    const uint16_t ninf = to16(-INFINITY), pinf = to16(INFINITY), nan = Fmt::is_nan(0x7FC0) ? 0x7FC0 : 0x7E00;
    std::vector<uint16_t> row(100);
    for (auto& b : row) b = to16(nd(rng));
    for (int i = 0; i < 30; ++i) row[rng() % 100] = ninf;
    for (double p : {1.0, 0.5, 0.99}) for (int64_t k : {0, 5, 80, 99}) check<Fmt>(name, row, 1.0, k, p, 0.0);
    row[7] = nan;
    row[9] = nan;
    row[13] = static_cast<uint16_t>(nan | 0x8000u);  // a negative NaN: keys below -inf's
    for (int64_t k : {0, 99}) check<Fmt>(name, row, 1.0, k, 1.0, 0.0);  // t = -inf
    for (double p : {1.0, 0.5}) for (int64_t k : {0, 5, 97, 98}) check<Fmt>(name, row, 1.0, k, p, 0.1);
    for (int64_t k : {5, 97, 98, 99}) check<Fmt>(name, row, 1.0, k, 1.0, 0.0);  // k vs the non-NaN count
    row[11] = pinf;
    check<Fmt>(name, row, 1.0, 5, 0.5, 0.1);
    std::vector<uint16_t> all(50, ninf);
    check<Fmt>(name, all, 1.0, 5, 0.5, 0.1);
    std::vector<uint16_t> zeros(64);
    for (size_t i = 0; i < zeros.size(); ++i) zeros[i] = i % 3 ? 0x0000 : 0x8000;  // +0 / -0
    zeros[5] = to16(-1.0f);
    zeros[6] = to16(1.0f);
    for (int64_t k : {0, 1, 2, 30, 63}) for (double p : {1.0, 0.3, 0.9}) check<Fmt>(name, zeros, 1.0, k, p, 0.0);
    std::vector<uint16_t> big(70001, to16(1.0f));
    for (int i = 0; i < 1000; ++i) big[rng() % big.size()] = to16(nd(rng) * 2.0f);
    check<Fmt>(name, big, 1.0, 60000, 0.9, 0.0);
    check<Fmt>(name, big, 1.0, 0, 0.999999, 0.0);
    check<Fmt>(name, big, 1.0, 68000, 1.0, 0.3);
    for (auto& b : big) b = b == to16(1.0f) ? ninf : b;
    check<Fmt>(name, big, 1.0, 900, 0.9, 0.0);
    check<Fmt>(name, big, 1.0, 60000, 0.999, 0.0);
  }
  // short rows thick with +0 / -0, -inf, NaN of both signs and +inf, of one sign or both or
  // integer ties, random rules and temperatures far from 1, four tokens a row: every path
  // of the kept statistics (bins with and without window 1's sums, a cut at +0 or -0, a max
  // at +0 beside -0 entries, a NaN or -inf token, a missing one)
  {
    const uint16_t ninf = to16(-INFINITY), pinf = to16(INFINITY);
    const uint16_t nan = Fmt::is_nan(0x7FC0) ? 0x7FC0 : 0x7E00;
    const double invs[] = {1e-8, 1e-3, 1.0, 40.0, 1e3, 1e8};
    const double ps[] = {1.0, 0.1, 0.5, 0.9, 0.999, 1.0 - 0x1p-53};
    const double mps[] = {0.0, 0.0, 0.01, 0.5, 0.99};
    for (int rep = 0; rep < 300; ++rep) {
      const int64_t V = 1 + static_cast<int64_t>(rng() % (rep % 10 == 0 ? 3000 : 40));
      const int kind = static_cast<int>(rng() % 5);  // near 0, positive, negative, ties, +inf
      std::vector<uint16_t> row(V);
      for (auto& b : row) {
        const float v = kind == 3 ? static_cast<float>(static_cast<int>(rng() % 5) - 2)
                                  : nd(rng) * (kind == 0 ? 0.01f : 3.0f) +
                                        (kind == 1 ? 5.0f : kind == 2 ? -5.0f : 0.0f);
        const int r = static_cast<int>(rng() % 100);
        b = r < 8 ? 0x0000 : r < 16 ? 0x8000 : r < 20 ? ninf : r < 22 ? nan
            : r < 24 ? static_cast<uint16_t>(nan | 0x8000u | (rng() & 0x3F))
            : (r < 25 && kind == 4) ? pinf : to16(v);
      }
      if (rep % 7 == 0)  // every value negative (-0 included)
        for (auto& b : row)
          if (!Fmt::is_nan(b)) b |= 0x8000u;
      const int64_t k = rng() % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % (V + 1));
      const double p = ps[rng() % 6], mp = mps[rng() % 5], inv = invs[rng() % 6];
      for (int y = 0; y < 4; ++y) check<Fmt>(name, row, inv, k, p, mp, static_cast<int>(rng() % 8));
    }
  }
  // the same row at every address phase gives the same bits
  std::vector<uint16_t> row(777);
  for (auto& b : row) b = to16(nd(rng) * 3.0f);
  const double want = reference<Fmt>(row, 1.0, 20, 0.9, 0.01).thr;
  for (int ph = 0; ph < 8; ++ph) check<Fmt>(name, row, 1.0, 20, 0.9, 0.01, ph);
  (void)want;
}

int main() {
  std::mt19937_64 rng(1234);
  suite<Bf16Bits>("bf16", to_bf16, rng);
  suite<HalfBits>("fp16", to_half, rng);
  // keys order like values
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    for (uint32_t c : {b + 1, b + 257}) {
      if (c >= 0x10000u || Bf16Bits::is_nan(uint16_t(b)) || Bf16Bits::is_nan(uint16_t(c))) continue;
      const double vb = Bf16Bits::value(uint16_t(b)), vc = Bf16Bits::value(uint16_t(c));
      const uint32_t kb = key_of(uint16_t(b)), kc = key_of(uint16_t(c));
      if ((vb < vc) != (kb < kc) || (vb == vc && (b & 0x7FFFu))) {
        if (++g_fail <= 20) std::printf("FAIL key order %04x %04x\n", b, c);
      }
    }
  }
  std::printf("%d rows, %d within 1e-12 of a top-p boundary where the sums' order decides; "
              "%d rows' kept statistics (%d from the bins, the others by a sweep)\n", g_rows,
              g_boundary, g_kept, g_kept_bins);
  if (g_fail) {
    std::printf("%d failed\n", g_fail);
    return 1;
  }
  std::printf("emulate_threshold: all passed\n");
  return 0;
}
