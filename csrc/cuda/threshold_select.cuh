// The re-derived kept set's threshold of one row of bfloat16 / float16 logits, in one block
// (docs/SAMPLING.md, "The re-derived sets"): vLLM v1's min-p, top-k and top-p as a value
// threshold, found from an exact count histogram of the row's 16-bit values in shared memory
// in place of a sort.
//
// A 16-bit float's bits map to a key that orders like the value (key_of; NaN left out, as
// the CPU op's comparisons leave it), so a row is 65,536 possible values and a count
// per value says everything the rules ask: the k-th largest value, the lowest value that
// passes min-p, and top-p's masses as count x exp((v - max) / T) per distinct value, in
// float64, one exp per distinct value instead of one per entry. 65,536 uint32 counts do not
// fit in one block's shared memory, so the keys are counted one sign at a time (a window of
// 32,768 bins, 128 KiB): sweep 1 counts the negative values (and finds the max), sweep 2
// the non-negative ones, and each window is summed into groups of 64 bins (kept in shared
// memory) before the next one overwrites its bins. A query whose answer lies inside a group
// reads the bins, so it runs while its window is resident: the ranks of top-k and min-p
// that fall among the negatives after sweep 1, the others after sweep 2. Top-p walks down
// from the top of the non-negative window; only where the mass of the non-negative values
// that survive min-p / top-k is below top_p * mass (flat or mostly negative rows) does a
// third sweep count the negatives again. A row of negative values takes one sweep; a row
// whose cut (and top-p boundary) lies among the negatives skips sweep 2 without top-p.
// Every count is an integer (atomic adds, exact in any order); the float64 masses are
// summed in a fixed order (per group from its top bin down, then chunks of 16 groups, then
// the chunks of both windows from the top), so a row gives the same bits at any address
// and in any batch.
//
// The program is written once over a block policy (DeviceBlock below, HostBlock in
// host_check/emulate_threshold.cu): `each(f)` runs f(thread) for every thread and then a
// barrier, `one(f)` runs f on thread 0 and then a barrier. Fields of Smem that every thread
// reads outside a step are written once per row (a later write could overtake a slow
// thread's read).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <cuda_runtime.h>

#include "ex2.cuh"

#define PPO_SEL_HD __host__ __device__ __forceinline__

namespace ppo_cuda {
namespace select {

constexpr int kThreads = 512;
constexpr int kLanes = 32;
constexpr uint32_t kHalf = 0x8000;          // keys >= kHalf: the values >= +0 (window 1)
constexpr int kBins = 1 << 15;              // a window: the keys of one sign
constexpr int kGroup = kBins / kThreads;    // 64 bins, summed by one thread
constexpr int kChunk = kThreads / kLanes;   // 16 groups, summed by one lane of warp 0
constexpr uint32_t kNone = 0xFFFFFFFFu;

// ---------------------------------------------------------------- keys of 16-bit floats

// The key of a 16-bit float's bits: orders like the value. -0 and +0 are two adjacent keys
// of one value: a cut between them keeps the same set (x >= 0 holds for both), and a group's
// mass is the same split in two bins.
PPO_SEL_HD uint32_t key_of(uint16_t b) {
  return (b & 0x8000u) ? (~uint32_t(b) & 0xFFFFu) : (uint32_t(b) | 0x8000u);
}

PPO_SEL_HD uint16_t bits_of(uint32_t key) {
  return key & 0x8000u ? uint16_t(key & 0x7FFFu) : uint16_t(~key & 0xFFFFu);
}

struct Bf16Bits {
  static constexpr uint32_t kInf = 0x7F80u;  // the bits of +inf
  PPO_SEL_HD static bool is_nan(uint16_t b) { return (b & 0x7FFFu) > kInf; }
  PPO_SEL_HD static float to_float(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
  }
  PPO_SEL_HD static double value(uint16_t b) { return static_cast<double>(to_float(b)); }
};

struct HalfBits {
  static constexpr uint32_t kInf = 0x7C00u;
  PPO_SEL_HD static bool is_nan(uint16_t b) { return (b & 0x7FFFu) > kInf; }
  // the value from the bits (the host's conversion; +-inf for NaN bits, never asked)
  PPO_SEL_HD static double decode(uint16_t b) {
    const int e = (b >> 10) & 0x1F, m = b & 0x3FF;
    const double s = (b & 0x8000u) ? -1.0 : 1.0;
    if (e == 0x1F) return s * std::numeric_limits<double>::infinity();
    if (e == 0) return s * ldexp(static_cast<double>(m), -24);
    return s * ldexp(static_cast<double>(m | 0x400), e - 25);
  }
  // the same value (exact in float), by the conversion instruction on the device
  PPO_SEL_HD static float to_float(uint16_t b) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
#else
    return is_nan(b) ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(decode(b));
#endif
  }
  PPO_SEL_HD static double value(uint16_t b) { return static_cast<double>(to_float(b)); }
};

template <class Fmt>
PPO_SEL_HD double key_value(uint32_t key) {
  return Fmt::value(bits_of(key));
}

// ---------------------------------------------------------------- shared memory

// The sums of a window's bins at or above a key (bin_sums), relative to the row's max: the
// entries, those at the max key, the mass count x e of the others and their count x e d.
struct BinSums {
  uint32_t count, ties;
  double mass, sd;
};

struct Smem {
  uint32_t hist[kBins + kLanes];   // the resident window's counts, then a spare bin a lane
  uint32_t gcount[2][kThreads];    // per window, per group of kGroup bins (>= the cut)
  double gmass[2][kThreads];       // their masses (top-p only)
  uint32_t ru[kThreads], ru2[kThreads];  // reductions
  double ra[kThreads], rb[kThreads];
  uint32_t rc[2][kLanes];          // per window, chunk counts
  double rd[2][kLanes];            // and masses
  // written once per row (see the header comment)
  uint32_t maxkey1, n1, n_all;     // max key + 1 (0: no value), non-negatives, non-NaN
  uint32_t nz0;                    // the -0 entries (window 0's top bin)
  uint32_t kp, cnt_kp0, cnt_kp1, ck0, ck1, cm0, cm1, g1, g0, found1, found0;
  double total, above1, above0;
  BinSums w1all;                   // window 1's, before sweep 3 overwrites it
  // the kept statistics (kept_stats): the sums from the bins, or by the sweep
  BinSums kbins, ksweep;
  double kmax;
};

// What row_threshold leaves in the bins, in every thread (its control flow is the block's):
// the resident window (-1: none that holds the kept set's lowest key) and that key, and
// whether Smem::w1all holds window 1 (the kept set then takes all of it).
struct Resident {
  int window = -1;
  uint32_t key = 0;
  bool w1all = false;
};

// ---------------------------------------------------------------- per-thread pieces

// f(bits) for every entry of the row that thread `tid` of kThreads reads: the entries in
// 16-byte packs where the row allows (order does not matter: counts and a max).
template <class F>
PPO_SEL_HD void for_each_bits(const uint16_t* x, int64_t V, int tid, F&& f) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(x);
  int64_t head = static_cast<int64_t>(((16 - (a & 15)) & 15) / 2);
  if (a & 1) head = V;  // never for a 2-byte dtype; kept safe
  if (head > V) head = V;
  for (int64_t j = tid; j < head; j += kThreads) f(x[j]);
  const int64_t packs = (V - head) / 8;
  const uint4* q = reinterpret_cast<const uint4*>(x + head);
  auto pack = [&](const uint4& v) {
    uint16_t e[8];
    memcpy(e, &v, sizeof(e));
#pragma unroll
    for (int u = 0; u < 8; ++u) f(e[u]);
  };
  int64_t i = tid;
  // four 16-byte loads in flight a thread (one block an SM: 16 warps to cover the latency)
  for (; i + 3 * kThreads < packs; i += 4 * kThreads) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = q[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) pack(v[u]);
  }
  for (; i < packs; i += kThreads) pack(q[i]);
  for (int64_t j = head + packs * 8 + tid; j < V; j += kThreads) f(x[j]);
}

// The mass of one bin: count x exp((v - max) / T) in float64 (0 for an empty bin).
template <class Fmt>
PPO_SEL_HD double bin_mass(uint32_t count, uint32_t key, double mx, double inv) {
  return count ? static_cast<double>(count) * exp((key_value<Fmt>(key) - mx) * inv) : 0.0;
}

// Group t of window w from the resident bins, counting only keys >= lo (top bin first).
template <class Fmt>
PPO_SEL_HD void group_sums(Smem& s, int w, int t, uint32_t lo, bool masses, double mx,
                           double inv) {
  uint32_t c = 0;
  double m = 0.0;
  for (int b = kGroup - 1; b >= 0; --b) {
    const uint32_t key = (uint32_t(w) << 15) | uint32_t(t * kGroup + b);
    const uint32_t n = key >= lo ? s.hist[t * kGroup + b] : 0u;
    c += n;
    if (masses) m += bin_mass<Fmt>(n, key, mx, inv);
  }
  s.gcount[w][t] = c;
  s.gmass[w][t] = m;
}

// The lowest key whose value passes min-p, (v - max) / T >= log(min_p), by bisection over
// the keys below the max (the test is monotone in the key; -inf and NaN fail it).
template <class Fmt>
PPO_SEL_HD uint32_t min_p_key(uint32_t maxkey, double mx, double inv, double min_p) {
  const double lo = log(min_p);
  uint32_t a = 0, b = maxkey;  // the answer lies in [a, b]; b passes
  while (a < b) {
    const uint32_t mid = a + (b - a) / 2;
    const double v = key_value<Fmt>(mid);
    if (Fmt::is_nan(bits_of(mid)) || !((v - mx) * inv >= lo)) a = mid + 1; else b = mid;
  }
  return b;
}

// ---------------------------------------------------------------- block steps

// ru's first kThreads entries summed (their max with max_first) and ru2's summed, in a tree.
template <class Blk>
PPO_SEL_HD void reduce2(Blk& blk, Smem& s, bool max_first) {
  for (int h = kThreads / 2; h > 0; h >>= 1) {
    blk.each([&](int t) {
      if (t < h) {
        s.ru[t] = max_first ? (s.ru[t] > s.ru[t + h] ? s.ru[t] : s.ru[t + h]) : s.ru[t] + s.ru[t + h];
        s.ru2[t] += s.ru2[t + h];
      }
    });
  }
}

// ru / ru2 summed, rb summed and ra summed (its max with max_first), in a tree (a fixed
// order: the same bits for a row at any address and in any batch).
template <class Blk>
PPO_SEL_HD void reduce4(Blk& blk, Smem& s, bool max_first) {
  for (int h = kThreads / 2; h > 0; h >>= 1) {
    blk.each([&](int t) {
      if (t < h) {
        s.ru[t] += s.ru[t + h];
        s.ru2[t] += s.ru2[t + h];
        const double a = s.ra[t], b = s.ra[t + h];
        s.ra[t] = max_first ? (b > a ? b : a) : a + b;
        s.rb[t] += s.rb[t + h];
      }
    });
  }
}

// The BinSums of window w (resident) over the keys >= lo into *out (a field of Smem), the
// row's max at maxkey (mx): each bin's count x exp((v - mx) * inv) in float64, one exp a
// non-empty bin; per group from its top bin down, then reduce4's tree.
template <class Fmt, class Blk>
PPO_SEL_HD void bin_sums(Blk& blk, Smem& s, int w, uint32_t lo, uint32_t maxkey, double mx,
                         double inv, BinSums* out) {
  blk.each([&](int t) {
    uint32_t c = 0, ties = 0;
    double m = 0.0, sd = 0.0;
    for (int b = kGroup - 1; b >= 0; --b) {
      const uint32_t key = (uint32_t(w) << 15) | uint32_t(t * kGroup + b);
      const uint32_t n = key >= lo ? s.hist[t * kGroup + b] : 0u;
      if (n == 0) continue;
      c += n;
      if (key == maxkey) {
        ties += n;
        continue;
      }
      const double d = (key_value<Fmt>(key) - mx) * inv, e = exp(d);
      m += static_cast<double>(n) * e;
      if (e > 0.0) sd += static_cast<double>(n) * e * d;  // (-inf: no term)
    }
    s.ru[t] = c;
    s.ru2[t] = ties;
    s.ra[t] = m;
    s.rb[t] = sd;
  });
  reduce4(blk, s, false);
  blk.one([&] { *out = BinSums{s.ru[0], s.ru2[0], s.ra[0], s.rb[0]}; });
}

// Chunk totals of window w's groups into rc[w] / rd[w] (lane t of warp 0: the groups of
// chunk t, top group first).
template <class Blk>
PPO_SEL_HD void chunk_sums(Blk& blk, Smem& s, int w) {
  blk.each([&](int t) {
    if (t < kLanes) {
      uint32_t c = 0;
      double m = 0.0;
      for (int g = (t + 1) * kChunk - 1; g >= t * kChunk; --g) {
        c += s.gcount[w][g];
        m += s.gmass[w][g];
      }
      s.rc[w][t] = c;
      s.rd[w][t] = m;
    }
  });
}

// The key of window w (resident, unrestricted summaries) where the count from the window's
// top reaches `rank` (1 <= rank <= the window's count).
template <class Blk>
PPO_SEL_HD void count_select(Blk& blk, Smem& s, int w, uint32_t rank, uint32_t* out) {
  chunk_sums(blk, s, w);
  blk.one([&] {
    uint32_t above = 0;
    int c = kLanes - 1;
    for (; c > 0 && above + s.rc[w][c] < rank; --c) above += s.rc[w][c];
    int g = (c + 1) * kChunk - 1;
    for (; g > c * kChunk && above + s.gcount[w][g] < rank; --g) above += s.gcount[w][g];
    int b = kGroup - 1;
    for (;; --b) {
      above += s.hist[g * kGroup + b];
      if (above >= rank || b == 0) break;
    }
    *out = (uint32_t(w) << 15) | uint32_t(g * kGroup + b);
  });
}

// How many entries of window w (resident) have a key >= lo, into *out.
template <class Blk>
PPO_SEL_HD void count_at_least(Blk& blk, Smem& s, int w, uint32_t lo, uint32_t* out) {
  blk.each([&](int t) {
    const uint32_t k0 = (uint32_t(w) << 15) | uint32_t(t * kGroup);
    uint32_t c = 0;
    if (k0 >= lo) {
      c = s.gcount[w][t];
    } else if (k0 + kGroup > lo) {
      for (int b = 0; b < kGroup; ++b) c += k0 + b >= lo ? s.hist[t * kGroup + b] : 0u;
    }
    s.ru[t] = c;
    s.ru2[t] = 0;
  });
  reduce2(blk, s, false);
  blk.one([&] { *out = s.ru[0]; });
}

// Top-p's walk over window w (resident; summaries restricted to keys >= lo): from `above`
// (the mass of the keys above the window), the first key from the top where the mass
// reaches `target`: *found = 1 and *key, or *found = 0 and *above_out the window's total
// added. The chunks add in the order of the total the target came from, so the last window
// always reaches it; a group or bin that the chunk's sum reached but the finer sums did not
// (float64 rounding of another order) gives the chunk's or group's lowest non-empty key.
template <class Fmt, class Blk>
PPO_SEL_HD void mass_select(Blk& blk, Smem& s, int w, double above_in, double target,
                            uint32_t lo, double mx, double inv, uint32_t* found, uint32_t* key,
                            double* above_out) {
  chunk_sums(blk, s, w);
  blk.one([&] {
    double above = above_in;
    int c = kLanes - 1;
    for (; c >= 0; --c) {
      if (s.rc[w][c] == 0) continue;
      if (above + s.rd[w][c] >= target) break;
      above += s.rd[w][c];
    }
    if (c < 0) {
      *found = 0;
      *above_out = above;
      return;
    }
    int g = -1;
    for (int h = (c + 1) * kChunk - 1; h >= c * kChunk; --h) {
      if (s.gcount[w][h] == 0) continue;
      g = h;
      if (above + s.gmass[w][h] >= target) break;
      above += s.gmass[w][h];
    }
    uint32_t last = kNone;
    for (int b = kGroup - 1; b >= 0; --b) {
      const uint32_t k = (uint32_t(w) << 15) | uint32_t(g * kGroup + b);
      const uint32_t n = k >= lo ? s.hist[g * kGroup + b] : 0u;
      if (n == 0) continue;
      last = k;
      const double m = bin_mass<Fmt>(n, k, mx, inv);
      if (above + m >= target) break;
      above += m;
    }
    *found = 1;
    *key = last;
  });
}

// Sweep the row: window W's counts into the (zeroed) bins; with First, also each thread's
// max key + 1 and count of non-negative values into ru / ru2. Per entry, on the bits b: a
// non-negative value (+0 .. +inf) is b <= inf's bits, its bin b; a negative one (-0 .. -inf)
// is b - 0x8000 <= inf's bits, its bin 0xFFFF - b (key_of's low 15 bits); NaN is neither.
// An entry of the other window (or NaN) counts into its lane's spare bin: one atomic for
// every entry and no branch, and no two lanes of a warp on one spare bin.
template <class Fmt, int W, bool First, class Blk>
PPO_SEL_HD void sweep(Blk& blk, Smem& s, const uint16_t* x, int64_t V) {
  blk.each([&](int t) {
    for (int b = 0; b < kGroup; ++b) s.hist[t * kGroup + b] = 0;
  });
  blk.each([&](int t) {
    uint32_t pmax = 0, nmin = 0xFFFFu, n1 = 0;  // the largest b + 1 >= 0, the smallest b < 0
    const uint32_t spare = kBins + (t & (kLanes - 1));
    for_each_bits(x, V, t, [&](uint16_t bits) {
      const uint32_t b = bits;
      const bool pos = b <= Fmt::kInf, neg = b - 0x8000u <= Fmt::kInf;
      if (First) {
        pmax = (pos && b + 1 > pmax) ? b + 1 : pmax;
        nmin = (neg && b < nmin) ? b : nmin;
        n1 += pos ? 1u : 0u;
      }
      const uint32_t bin = W == 1 ? b : 0xFFFFu - b;
      Blk::add(&s.hist[(W == 1 ? pos : neg) ? bin : spare], 1u);
    });
    if (First) {
      s.ru[t] = pmax ? key_of(uint16_t(pmax - 1)) + 1 : (nmin != 0xFFFFu ? key_of(uint16_t(nmin)) + 1 : 0u);
      s.ru2[t] = n1;
    }
  });
}

// ---------------------------------------------------------------- the row program

// The row's threshold (raw logit units; -inf when nothing is cut), vLLM v1's rules on
// z = x * inv (docs/SAMPLING.md): min-p keeps (x - max) * inv >= log(min_p), top-k keeps
// x >= the k-th largest x (ties kept), top-p keeps, of the survivors S of both, the entries
// whose mass of S strictly above them is < top_p * mass(S). k <= 0 or k >= V, top_p >= 1 and
// min_p <= 0 are off. The result is in every thread.
// row_max: where given, the row's max (NaN left out) once sweep 1 has found it, else left
// as it was. res: where given, what the bins hold at the end (Resident; kept_stats sums the
// kept set from them where they hold all of it).
template <class Fmt, class Blk>
PPO_SEL_HD double row_threshold(Blk& blk, Smem& s, const uint16_t* x, int64_t V, double inv,
                                int64_t k, double p, double min_p, double* row_max = nullptr,
                                Resident* res = nullptr) {
  const double inf = std::numeric_limits<double>::infinity();
  const bool use_p = p < 1.0, use_m = min_p > 0.0;
  bool use_k = k > 0 && k < V;
  if (!use_k && !use_p && !use_m) return -inf;

  // sweep 1: the negatives' bins, the max, the counts
  sweep<Fmt, 0, true>(blk, s, x, V);
  reduce2(blk, s, true);
  blk.one([&] {
    s.maxkey1 = s.ru[0];
    s.n1 = s.ru2[0];
    s.nz0 = s.hist[kBins - 1];
  });
  if (s.maxkey1 == 0) return -inf;  // every entry NaN
  const uint32_t maxkey = s.maxkey1 - 1, n1 = s.n1;
  const double mx = key_value<Fmt>(maxkey);
  if (row_max) *row_max = mx;
  if (!(mx > -inf && mx < inf)) return -inf;
  blk.each([&](int t) { group_sums<Fmt>(s, 0, t, 0, false, mx, inv); });  // counts for ranks
  chunk_sums(blk, s, 0);
  blk.one([&] {  // the non-NaN entries
    uint32_t n = n1;
    for (int c = 0; c < kLanes; ++c) n += s.rc[0][c];
    s.n_all = n;
  });
  if (use_k && static_cast<uint64_t>(k) >= s.n_all) use_k = false;
  if (!use_k && !use_p && !use_m) return -inf;

  // min-p's lowest passing key, and its rank (how many entries are at or above it)
  if (use_m) blk.one([&] { s.kp = min_p_key<Fmt>(maxkey, mx, inv, min_p); });
  const uint32_t kp = use_m ? s.kp : 0;
  if (use_m && kp < kHalf) count_at_least(blk, s, 0, kp, &s.cnt_kp0);
  // where each cut lies: among the non-negatives (rank <= n1) or the negatives
  const uint32_t rank_k = use_k ? static_cast<uint32_t>(k) : 0;
  const bool k_in_1 = use_k && rank_k <= n1;
  const bool m_in_1 = use_m && (kp >= kHalf || s.cnt_kp0 == 0);
  const bool cut_in_1 = k_in_1 || m_in_1;
  uint32_t cut = 0;  // the lowest surviving key (0: no cut; key 0 is a NaN)
  if (!cut_in_1) {
    if (use_k) count_select(blk, s, 0, rank_k - n1, &s.ck0);
    if (use_m) count_select(blk, s, 0, s.cnt_kp0, &s.cm0);
    if (use_k) cut = s.ck0;
    if (use_m) cut = s.cm0 > cut ? s.cm0 : cut;
    if (!use_p) return key_value<Fmt>(cut);
    blk.each([&](int t) { group_sums<Fmt>(s, 0, t, cut, true, mx, inv); });
  } else {
    blk.each([&](int t) {  // every negative lies below the cut
      s.gcount[0][t] = 0;
      s.gmass[0][t] = 0.0;
    });
  }
  chunk_sums(blk, s, 0);

  // sweep 2: the non-negatives (n1 > 0 wherever the cut lies among them)
  if (n1 > 0) {
    sweep<Fmt, 1, false>(blk, s, x, V);
    blk.each([&](int t) { group_sums<Fmt>(s, 1, t, 0, use_p && !cut_in_1, mx, inv); });
    if (cut_in_1) {
      uint32_t ck = 0, cm = 0;  // 0: that cut lies among the negatives, below the other
      if (m_in_1) {
        // kp among the negatives with none of them at or above it: the lowest non-negative
        if (kp >= kHalf) count_at_least(blk, s, 1, kp, &s.cnt_kp1);
        count_select(blk, s, 1, kp >= kHalf ? s.cnt_kp1 : n1, &s.cm1);
        cm = s.cm1;
      }
      if (k_in_1) {
        count_select(blk, s, 1, rank_k, &s.ck1);
        ck = s.ck1;
      }
      cut = ck > cm ? ck : cm;
      // a cut at +0 keeps the -0 entries too (one value, two keys): the lowest surviving
      // key is then -0's, in window 0 (only top-k's rank lands on +0: min-p's lowest passing
      // key is -0's wherever 0 passes)
      if (cut == kHalf) cut = kHalf - 1;
      if (!use_p) {
        if (res && cut >= kHalf) *res = Resident{1, cut, false};
        return key_value<Fmt>(cut);
      }
      blk.each([&](int t) { group_sums<Fmt>(s, 1, t, cut, true, mx, inv); });
      if (cut < kHalf) {  // window 0's surviving bin: -0's, its top (counted in sweep 1)
        blk.one([&] {
          s.gcount[0][kThreads - 1] = s.nz0;
          s.gmass[0][kThreads - 1] = bin_mass<Fmt>(s.nz0, cut, mx, inv);
        });
        chunk_sums(blk, s, 0);
      }
    }
  } else {
    blk.each([&](int t) {
      s.gcount[1][t] = 0;
      s.gmass[1][t] = 0.0;
    });
  }
  chunk_sums(blk, s, 1);
  // mass(S): the chunks from the top, in the order the walks below add them
  blk.one([&] {
    double m = 0.0;
    for (int w = 1; w >= 0; --w)
      for (int c = kLanes - 1; c >= 0; --c)
        if (s.rc[w][c]) m += s.rd[w][c];
    s.total = m;
  });
  const double target = p * s.total;  // <= the total: the walk ends by the last survivor

  // top-p: down from the top, the non-negatives first
  double above = 0.0;
  if (n1 > 0) {
    mass_select<Fmt>(blk, s, 1, 0.0, target, cut, mx, inv, &s.found1, &s.g1, &s.above1);
    if (s.found1) {
      if (res) *res = Resident{1, s.g1, false};
      return key_value<Fmt>(s.g1);
    }
    above = s.above1;  // then negatives survive (the total is more than this window's)
    // (every non-negative is kept then: cut lies among the negatives, or the walk would
    // have ended in window 1)
    if (res) bin_sums<Fmt>(blk, s, 1, 0, maxkey, mx, inv, &s.w1all);
    sweep<Fmt, 0, false>(blk, s, x, V);  // sweep 3: the negatives again
  }
  mass_select<Fmt>(blk, s, 0, above, target, cut, mx, inv, &s.found0, &s.g0, &s.above0);
  if (!s.found0) return -inf;  // (not reached: the walk ends by the last survivor)
  if (res) *res = Resident{0, s.g0, n1 > 0};
  return key_value<Fmt>(s.g0);
}

// ---------------------------------------------------------------- the kept statistics

// The statistics of a row's kept set K = {j : x_j >= t} plus the token y where K lacks it,
// as csrc/cpu/sampling.cpp's kept_logprobs_fwd computes them (docs/SAMPLING.md): top, the
// kept max (the token's value where K is empty, NaN for a NaN token it lacks); rest, the
// mass below the top with the ties at the top beyond one (log_sum = log1p(rest)); sd, sum
// e d; the size; missing; xy, the token's value (NaN for a NaN entry). In every thread.
struct KeptRowStats {
  double top, rest, sd;
  uint32_t size;
  bool missing;
  double xy;
};

// The statistics of K from its sums (BinSums relative to top) and the token y, which joins
// K where K lacks it (missing; its value xy): the ties at the top beyond one counted in
// rest, as log_sum = log1p(rest) takes them.
PPO_SEL_HD KeptRowStats with_token(double top, const BinSums& b, bool missing, double xy,
                                   double inv) {
  KeptRowStats k{top, b.mass, b.sd, b.count, missing, xy};
  double ties = b.ties;
  if (missing) {
    ++k.size;
    const double dy = (xy - top) * inv, e = exp(dy);
    if (xy == top) ties += 1.0; else k.rest += e;
    if (e > 0 && xy != top) k.sd += e * dy;
  }
  k.rest += ties > 1.0 ? ties - 1.0 : 0.0;
  return k;
}

// kept_logprobs_fwd's statistics of row x on threshold t, y_bits the token's entry.
// Where row_threshold's bins hold the kept set K = {x >= t} (res: its lowest key in the
// resident window, window 1 all kept or summed in w1all) the sums come from the bins
// (bin_sums: float64, one exp a distinct value, no further read of the row): top-p, and
// top-k / min-p cuts among the non-negatives. Else (no cut, a cut among the negatives
// without top-p, a cut at +0 with -0 entries outside the window, a NaN token K lacks) a
// sweep: with the row's max known (row_threshold's row_max; NaN: not known) one, else one
// for the kept max first; it tests an entry as a float compare and takes its mass as a
// float exp2 (ex2.cuh), summed in float a thread (the accumulation type of 16-bit rows, as
// the kept kernels take it), then in double over the threads.
template <class Fmt, class Blk>
PPO_SEL_HD KeptRowStats kept_stats(Blk& blk, Smem& s, const uint16_t* x, int64_t V, double t,
                                   double known_max, double inv, uint16_t y_bits,
                                   const Resident& res = Resident{}) {
  const double inf = std::numeric_limits<double>::infinity();
  // the token where K lacks it (x_y < t, or NaN) joins K: the top where K is empty
  const bool y_nan = Fmt::is_nan(y_bits);
  const double xy = y_nan ? std::numeric_limits<double>::quiet_NaN() : Fmt::value(y_bits);
  const bool missing = !(xy >= t);
  // (K holds the max: t is at most it; a cut at +0 also keeps -0, in window 0)
  if (res.window >= 0 && !(missing && y_nan) && !(res.window == 1 && res.key == kHalf)) {
    bin_sums<Fmt>(blk, s, res.window, res.key, s.maxkey1 - 1, known_max, inv, &s.kbins);
    BinSums b = s.kbins;
    if (res.w1all) {
      b.count += s.w1all.count;
      b.ties += s.w1all.ties;
      b.mass += s.w1all.mass;
      b.sd += s.w1all.sd;
    }
    return with_token(known_max, b, missing, xy, inv);  // (x_y < t <= the max if missing)
  }
  double top0 = known_max;
  if (!(known_max == known_max)) {  // the kept max: a sweep
    blk.each([&](int th) {
      double m = -inf;
      for_each_bits(x, V, th, [&](uint16_t b) {
        const double v = Fmt::value(b);
        if (!Fmt::is_nan(b) && v >= t && v > m) m = v;
      });
      s.ra[th] = m;
      s.rb[th] = 0.0;
      s.ru[th] = s.ru2[th] = 0;
    });
    reduce4(blk, s, true);
    blk.one([&] { s.kmax = s.ra[0]; });
    top0 = s.kmax;
  }
  double top = top0;
  if (missing && (top0 == -inf || xy > top0 || y_nan)) top = xy;
  // K as a float compare: x >= t in double is x >= t_f for every 16-bit x (exact in
  // float), t_f the smallest float at or above t; NaN fails it
  float t_f = static_cast<float>(t);
  if (static_cast<double>(t_f) < t) t_f = nextafterf(t_f, inf);
  // base 2: e = 2^d2 with d2 = (v - top) * inv * log2(e) (one ex2 an entry, ex2.cuh), sum
  // e d = ln(2) sum e d2
  const float topf = static_cast<float>(top);
  const float inv2 = static_cast<float>(inv * 1.4426950408889634);
  blk.each([&](int th) {
    float rest = 0.0f, sd = 0.0f;
    uint32_t n = 0, ties = 0;
    for_each_bits(x, V, th, [&](uint16_t b) {  // (branch-free: selects, no jumps)
      const float v = Fmt::to_float(b);
      const bool in = v >= t_f;
      const bool tie = in && v == topf;
      const float d2 = (v - topf) * inv2;
      const float e = in && !tie ? ex2_approx(d2) : 0.0f;
      n += in ? 1u : 0u;
      ties += tie ? 1u : 0u;
      rest += e;
      sd += e > 0.0f ? e * d2 : 0.0f;
    });
    s.ra[th] = rest;
    s.rb[th] = sd;
    s.ru[th] = n;
    s.ru2[th] = ties;
  });
  reduce4(blk, s, false);
  blk.one([&] { s.ksweep = BinSums{s.ru[0], s.ru2[0], s.ra[0], s.rb[0] * 0.6931471805599453}; });
  return with_token(top, s.ksweep, missing, xy, inv);
}

// ---------------------------------------------------------------- the device policy

struct DeviceBlock {
  template <class F>
  PPO_SEL_HD void each(F&& f) {
#if defined(__CUDA_ARCH__)
    f(static_cast<int>(threadIdx.x));
    __syncthreads();
#endif
  }
  template <class F>
  PPO_SEL_HD void one(F&& f) {
#if defined(__CUDA_ARCH__)
    if (threadIdx.x == 0) f();
    __syncthreads();
#endif
  }
  PPO_SEL_HD static void add(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    atomicAdd(p, v);
#else
    *p += v;
#endif
  }
};

}  // namespace select
}  // namespace ppo_cuda
