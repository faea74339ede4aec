// Host emulation of the CUDA GAE kernel (gae_scan.cuh): the kernel's own per-thread phases
// (gae_load, gae_next_value_map, gae_deltas, gae_store, gae_delta_map, gae_store_returns,
// gae_lambda, gae_last_valid) driven tile by tile
// with a sequential exclusive scan standing in for block_exclusive_scan, checked against the
// plain sequential recursion of ppo_kernels/reference.py (masked positions transparent,
// bootstrap values, score added at the last valid token, a lambda per sequence, returns of a
// decoupled value_lam). The shuffles and barriers of the
// block scan itself are only checked by a GPU run.
//
//   nvcc -std=c++20 -O1 -I csrc csrc/cuda/host_check/emulate_gae.cu -o /tmp/emu_gae && /tmp/emu_gae
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "../gae_scan.cuh"

using namespace ppo_cuda;

static int g_fail = 0;

template <typename A>
void emulate(GaeArgs<A> g, int64_t B, int nthr) {
  for (int64_t seq = 0; seq < B; ++seq) {
    const A gl = g.gamma * gae_lambda(g, seq);
    const A glv = g.gamma * g.value_lam;
    int64_t last = -1;
    A score = A(0);
    if (g.scores) {
      for (int tid = 0; tid < nthr; ++tid) last = std::max(last, gae_last_valid(g, seq, tid, nthr));
      score = g.scores[seq];
    }
    A carry_v = g.bootstrap ? g.bootstrap[seq] : A(0);
    A carry_a = A(0), carry_g = A(0);
    const int64_t tile = static_cast<int64_t>(nthr) * kGaeItems;
    std::vector<GaeThread<A>> th(nthr);
    std::vector<Affine<A>> m(nthr), e(nthr);
    for (int64_t hi = g.T; hi > 0; hi -= tile) {
      for (int tid = 0; tid < nthr; ++tid) {
        gae_load(g, seq, hi, tid, last, score, th[tid]);
        m[tid] = gae_next_value_map(th[tid]);
      }
      Affine<A> run = affine_identity<A>();
      for (int tid = 0; tid < nthr; ++tid) {
        e[tid] = run;
        run = compose(run, m[tid]);
      }
      for (int tid = 0; tid < nthr; ++tid)
        m[tid] = gae_deltas(th[tid], e[tid].a + e[tid].c * carry_v, g.gamma, gl);
      carry_v = run.a + run.c * carry_v;
      run = affine_identity<A>();
      for (int tid = 0; tid < nthr; ++tid) {
        e[tid] = run;
        run = compose(run, m[tid]);
      }
      for (int tid = 0; tid < nthr; ++tid)
        gae_store(g, seq, th[tid], e[tid].a + e[tid].c * carry_a, gl);
      carry_a = run.a + run.c * carry_a;
      if (g.decoupled) {
        run = affine_identity<A>();
        for (int tid = 0; tid < nthr; ++tid) {
          e[tid] = run;
          run = compose(run, gae_delta_map(th[tid], glv));
        }
        for (int tid = 0; tid < nthr; ++tid)
          gae_store_returns(g, seq, th[tid], e[tid].a + e[tid].c * carry_g, glv);
        carry_g = run.a + run.c * carry_g;
      }
    }
  }
}

template <typename A>
void check(int64_t B, int64_t T, int nthr, bool boot, bool scores, double p_mask,
           std::mt19937& rng, bool per_seq = false, bool decoupled = false) {
  std::uniform_real_distribution<double> u(-1.0, 1.0), coin(0.0, 1.0);
  const int64_t n = B * T;
  std::vector<A> r(n), v(n), adv(n, A(NAN)), ret(n, A(NAN)), bs(B), sc(B), ls(B);
  std::vector<char> mk(n);
  for (int64_t k = 0; k < n; ++k) {
    r[k] = static_cast<A>(u(rng));
    v[k] = static_cast<A>(u(rng));
    mk[k] = coin(rng) >= p_mask;
  }
  for (int64_t b = 0; b < B; ++b) {
    bs[b] = static_cast<A>(u(rng));
    sc[b] = static_cast<A>(3 * u(rng));
    ls[b] = static_cast<A>(coin(rng));
  }
  const double gamma = 0.99, lam = 0.95, value_lam = 1.0;
  // reference (reference.py: gae, kl_penalized_rewards' score placement)
  std::vector<double> rr(r.begin(), r.end()), radv(n, 0.0), rret(n, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    if (scores)
      for (int64_t t = T - 1; t >= 0; --t)
        if (mk[b * T + t]) {
          rr[b * T + t] += sc[b];
          break;
        }
    const double lam_b = per_seq ? double(ls[b]) : lam;
    double v_next = boot ? bs[b] : 0.0, a_next = 0.0, g_next = 0.0;
    for (int64_t t = T - 1; t >= 0; --t) {
      const int64_t k = b * T + t;
      if (!mk[k]) continue;
      const double delta = rr[k] + gamma * v_next - v[k];
      a_next = delta + gamma * lam_b * a_next;
      g_next = delta + gamma * value_lam * g_next;
      v_next = v[k];
      radv[k] = a_next;
      rret[k] = (decoupled ? g_next : a_next) + v[k];
    }
  }
  GaeArgs<A> g;
  g.rewards = r.data();
  g.rewards_out = scores ? r.data() : nullptr;
  g.values = v.data();
  g.mask = reinterpret_cast<const bool*>(mk.data());
  g.bootstrap = boot ? bs.data() : nullptr;
  g.scores = scores ? sc.data() : nullptr;
  g.adv = adv.data();
  g.ret = ret.data();
  g.T = T;
  g.gamma = static_cast<A>(gamma);
  g.lam = static_cast<A>(lam);
  g.lam_per_seq = per_seq ? ls.data() : nullptr;
  g.decoupled = decoupled;
  g.value_lam = static_cast<A>(value_lam);
  emulate(g, B, nthr);
  const double tol = sizeof(A) == 8 ? 1e-10 : 2e-4;
  int bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double sa = std::max(1.0, std::fabs(radv[k])), sr = std::max(1.0, std::fabs(rret[k]));
    if (!(std::fabs(adv[k] - radv[k]) <= tol * sa && std::fabs(ret[k] - rret[k]) <= tol * sr))
      ++bad;
    if (scores && !(std::fabs(r[k] - rr[k]) <= 1e-6)) ++bad;
  }
  if (bad) {
    if (g_fail < 20)
      std::printf("B=%lld T=%lld nthr=%d boot=%d scores=%d p_mask=%.2f per_seq=%d "
                  "decoupled=%d: %d wrong\n", (long long)B, (long long)T, nthr, boot, scores,
                  p_mask, per_seq, decoupled, bad);
    ++g_fail;
  }
}

int main() {
  std::mt19937 rng(7);
  int cases = 0;
  for (int64_t T : {1, 2, 7, 8, 9, 255, 256, 257, 1000, 2049, 9000})
    for (int nthr : {32, 64, 1024})
      for (int flags = 0; flags < 16; ++flags)
        for (double pm : {0.0, 0.3, 0.9, 1.0}) {
          check<float>(3, T, nthr, flags & 1, flags & 2, pm, rng, flags & 4, flags & 8);
          check<double>(2, T, nthr, flags & 1, flags & 2, pm, rng, flags & 4, flags & 8);
          cases += 2;
        }
  check<float>(8, 32768, 1024, true, true, 0.2, rng);  // the long-T benchmark shape
  check<float>(8, 32768, 1024, true, true, 0.2, rng, true, true);
  cases += 2;
  std::printf(g_fail ? "FAILED: %d of %d\n" : "all %d passed\n", g_fail ? g_fail : cases, cases);
  return g_fail ? 1 : 0;
}
