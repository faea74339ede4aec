// CUDA token_logprobs_fwd / token_logprobs_bwd (schemas in csrc/ops.cpp).
//
// fwd: one pass over the logits (row_kernels.cuh, no gradient sweep): logprob of the
//      sampled token, entropy (when asked), the raw row max and log_sum = log1p(rest) per
//      position (docs/DESIGN.md, Precision), 0 on masked positions.
// bwd: one pass that reads the logits and writes dlogits, from the saved row_max, log_sum
//      (and entropy): dlogits_v = (glp (1[v = tok] - p_v) - gent p_v (log p_v + H)) / T,
//      with log p_v = (x_v - row_max) / T - log_sum (never through lse, whose
//      FMA residue on the max entry was +213 at T = 1e-10); grid (row, chunk) so even a
//      handful of rows fills the chip.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "row_kernels.cuh"

namespace ppo_cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd_cuda(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
    double temperature, bool return_entropy, const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  const auto acc_opts = r.acc_opts;
  const int64_t B = r.B, T = r.T;
  at::Tensor logp = at::empty({B, T}, acc_opts);
  at::Tensor ent = return_entropy ? at::empty({B, T}, acc_opts) : at::empty({0}, acc_opts);
  at::Tensor row_max = at::empty({B, T}, acc_opts);
  at::Tensor log_sum = at::empty({B, T}, acc_opts);
  if (B * T == 0) return {logp, ent, row_max, log_sum};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.device().index();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_fwd_cuda", [&] {
        using A = acc_of<scalar_t>;
        RowsView<scalar_t> rv = make_view<scalar_t>(logits, r);
        TokenIO<A> io = empty_io<A>(kModeLogprobs);
        io.logp = logp.data_ptr<A>();
        io.entropy = return_entropy ? ent.data_ptr<A>() : nullptr;
        io.row_max = row_max.data_ptr<A>();
        io.log_sum = log_sum.data_ptr<A>();
        run_rows<scalar_t>(rv, io, make_row_temp<A>(r), acc_opts, device, stream);
      });
  return {logp, ent, row_max, log_sum};
}

at::Tensor token_logprobs_bwd_cuda(const at::Tensor& grad_logprobs,
                                   const std::optional<at::Tensor>& grad_entropy,
                                   const at::Tensor& logits, const at::Tensor& tokens,
                                   const at::Tensor& mask, const at::Tensor& row_max_in,
                                   const at::Tensor& log_sum_in, const at::Tensor& entropy_in,
                                   double temperature,
                                   const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  const at::Tensor glp = r.per_token(grad_logprobs, "grad_logprobs");
  const at::Tensor row_max = r.per_token(row_max_in, "row_max");
  const at::Tensor log_sum = r.per_token(log_sum_in, "log_sum");
  const std::optional<at::Tensor> gent = r.per_token(grad_entropy, "grad_entropy");
  std::optional<at::Tensor> ent;
  if (gent.has_value()) {
    // the entropy is needed only for the entropy term of the gradient
    ent = r.per_token(entropy_in, "entropy");
  }
  const int64_t B = r.B, Tl = r.Tl, V = r.V;
  at::Tensor dlogits = at::empty({B, Tl, V}, logits.options());  // contiguous
  if (B * Tl == 0) return dlogits;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "token_logprobs_bwd_cuda", [&] {
        using A = acc_of<scalar_t>;
        RowsView<scalar_t> rv = make_view<scalar_t>(logits, r);
        rv.out = dlogits.data_ptr<scalar_t>();
        rv.oB = Tl * V;
        rv.oT = V;
        const ChunkPlan cp = chunk_plan<scalar_t>(V);
        GradSource<A> src{nullptr, row_max.data_ptr<A>(), log_sum.data_ptr<A>(),
                          ptr_or_null<A>(ent), glp.data_ptr<A>(), ptr_or_null<A>(gent)};
        TORCH_CHECK(B * Tl <= 0x7fffffff, "logits: too many rows for one launch (", B * Tl,
                    ")");
        grad_chunks_kernel<scalar_t>
            <<<dim3(static_cast<unsigned>(B * Tl), static_cast<unsigned>(cp.S)), cp.threads, 0,
               stream>>>(rv, make_row_temp<A>(r), cp.chunk, src);
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
