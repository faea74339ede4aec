// CUDA token_logprobs_fwd / token_logprobs_bwd (schemas in csrc/ops.cpp).
//
// fwd: one pass over the logits (row_kernels.cuh, no gradient sweep): logprob of the
//      sampled token, entropy (when asked) and lse per position, 0 on masked positions.
// bwd: one pass that reads the logits and writes dlogits, from the saved lse (and entropy):
//      dlogits_v = (glp (1[v = tok] - p_v) - gent p_v (log p_v + H)) / temperature,
//      ppo::dlogit; grid (row, chunk) so even a handful of rows fills the chip.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "row_kernels.cuh"

namespace ppo_cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd_cuda(
    const at::Tensor& logits, const at::Tensor& tokens_in, const at::Tensor& mask_in,
    double temperature, bool return_entropy) {
  check_logits(logits, tokens_in, mask_in);
  check_temperature(temperature, logits.scalar_type());
  c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor tokens = tokens_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  const auto acc_opts = logits.options().dtype(acc_dtype(logits.scalar_type()));
  const int64_t B = tokens.size(0), T = tokens.size(1);
  at::Tensor logp = at::empty({B, T}, acc_opts);
  at::Tensor ent = return_entropy ? at::empty({B, T}, acc_opts) : at::empty({0}, acc_opts);
  at::Tensor lse = at::empty({B, T}, acc_opts);
  if (B * T == 0) return {logp, ent, lse};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.device().index();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_fwd_cuda", [&] {
        using A = acc_of<scalar_t>;
        RowsView<scalar_t> rv = make_view<scalar_t>(logits, tokens, mask);
        TokenIO<A> io = empty_io<A>(kModeLogprobs);
        io.logp = logp.data_ptr<A>();
        io.entropy = return_entropy ? ent.data_ptr<A>() : nullptr;
        io.lse = lse.data_ptr<A>();
        run_rows<scalar_t>(rv, io, inv_temperature<A>(temperature), acc_opts, device, stream);
      });
  return {logp, ent, lse};
}

at::Tensor token_logprobs_bwd_cuda(const at::Tensor& grad_logprobs,
                                   const std::optional<at::Tensor>& grad_entropy,
                                   const at::Tensor& logits, const at::Tensor& tokens_in,
                                   const at::Tensor& mask_in, const at::Tensor& lse_in,
                                   const at::Tensor& entropy_in, double temperature) {
  check_logits(logits, tokens_in, mask_in);
  check_temperature(temperature, logits.scalar_type());
  c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor tokens = tokens_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  const auto acc = acc_dtype(logits.scalar_type());
  const auto dev = logits.device();
  const auto shape = tokens.sizes();
  const at::Tensor glp = per_token(grad_logprobs, "grad_logprobs", acc, shape, dev);
  const at::Tensor lse = per_token(lse_in, "lse", acc, shape, dev);
  const std::optional<at::Tensor> gent =
      opt_per_token(grad_entropy, "grad_entropy", acc, shape, dev);
  std::optional<at::Tensor> ent;
  if (gent.has_value()) {
    // the entropy is needed only for the entropy term of the gradient
    ent = per_token(entropy_in, "entropy", acc, shape, dev);
  }
  const int64_t B = logits.size(0), Tl = logits.size(1), V = logits.size(2);
  at::Tensor dlogits = at::empty({B, Tl, V}, logits.options());  // contiguous
  if (B * Tl == 0) return dlogits;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_bwd_cuda", [&] {
        using A = acc_of<scalar_t>;
        constexpr int64_t N = Pack<scalar_t>::N;
        RowsView<scalar_t> rv = make_view<scalar_t>(logits, tokens, mask);
        rv.out = dlogits.data_ptr<scalar_t>();
        rv.oB = Tl * V;
        rv.oT = V;
        // about four packs per thread of a 256-thread block per chunk
        const int threads = threads_for(ceil_div(V, N), kChunkThreads);
        int64_t chunk = static_cast<int64_t>(threads) * 4 * N;
        chunk = std::max(chunk, ceil_div(ceil_div(V, int64_t(65535)), N) * N);
        const int64_t S = ceil_div(V, chunk);
        GradSource<A> src{nullptr, lse.data_ptr<A>(), ptr_or_null<A>(ent), glp.data_ptr<A>(),
                          ptr_or_null<A>(gent)};
        grad_chunks_kernel<scalar_t>
            <<<dim3(static_cast<unsigned>(B * Tl), static_cast<unsigned>(S)), threads, 0,
               stream>>>(rv, inv_temperature<A>(temperature), chunk, src);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return dlogits;
}

}  // namespace
}  // namespace ppo_cuda

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) {
  m.impl("token_logprobs_fwd", &ppo_cuda::token_logprobs_fwd_cuda);
  m.impl("token_logprobs_bwd", &ppo_cuda::token_logprobs_bwd_cuda);
}
