// CUDA ppo_loss_fwd / ppo_loss_fwd_inplace (schemas in csrc/ops.cpp).
//
// One launch reads every valid row of the logits once, computes logprob and entropy, the
// per-token loss and its derivatives (ppo::token_loss), and, when a gradient is wanted,
// writes dlogits in a second sweep of the same row while it is in L2 (row_kernels.cuh).
// Since loss = sum_i w_i loss_i with w known up front, the autograd backward only scales
// this dlogits by grad_output: one DRAM read and one DRAM write of [N, V] in total. The
// dlogits written are grad_scale * d loss / d logits (dlogp and dent times grad_scale in the
// token epilogue), so a known loss scale (gradient accumulation) costs no pass at all, and
// any other grad_output one in-place pass (scale_grad.cu), never an [N, V] allocation.
// A second tiny launch reduces loss = sum(w * loss_tok) in a fixed order (deterministic).
// The loss menu is all in the per-token epilogue (token_epilogue.cuh ->
// ppo::token_loss): policy_loss vanilla / cispo / sapo / dppo-tv / dppo-kl, kl_estimator
// k1..k3+, the KL bias correction, on-policy (old_logprobs None: old = logp) and
// entropy_weights (the gradient's
// d loss / d H = -entropy_weights * entropy_coef; the loss output stays sum(w * loss_tok),
// the Python layer corrects its entropy part when entropy_agg_mode differs).
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include "../loss_args.h"
#include "row_kernels.cuh"

namespace ppo_cuda {
namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;

// Returns (loss, loss_tok, logprobs, entropy, dlogits); dlogits is numel 0 when no gradient
// is asked for, and undefined when it was written over the logits (inplace).
// old_logprobs None: on-policy (the kernel takes old = logp); entropy_weights None: weights.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ppo_loss_impl(const ppo::OpArgs& args,
                                                                 bool compute_grad,
                                                                 bool inplace) {
  const Tensor logits = args.tensor("logits");
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const ppo::LossArgs a = ppo::loss_args(args);
  const RowArgs& r = a.rows;
  const ppo::LossTensors& in = a.in;
  const ppo::PolicyParams& params = a.params;
  if (inplace) at::assert_no_internal_overlap(logits);

  const auto acc_opts = r.acc_opts;
  const int64_t B = r.B, Tl = r.Tl, V = r.V, T = r.T;
  Tensor loss = at::empty({}, acc_opts);
  Tensor loss_tok = at::empty({B, T}, acc_opts);
  Tensor logp = at::empty({B, T}, acc_opts);
  Tensor ent = at::empty({B, T}, acc_opts);
  Tensor dlogits;
  if (!inplace) {
    dlogits = compute_grad ? at::empty({B, Tl, V}, logits.options())  // contiguous
                           : at::empty({0}, logits.options());
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.device().index();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "ppo_loss_fwd_cuda", [&] {
        using A = acc_of<scalar_t>;
        RowsView<scalar_t> rv = make_view<scalar_t>(logits, r);
        if (inplace) {
          rv.out = logits.data_ptr<scalar_t>();
          rv.oB = logits.stride(0);
          rv.oT = logits.stride(1);
        } else if (compute_grad) {
          rv.out = dlogits.data_ptr<scalar_t>();
          rv.oB = Tl * V;
          rv.oT = V;
        }
        TokenIO<A> io = empty_io<A>(kModePpo);
        io.old_logp = ptr_or_null<A>(in.old_logprobs);
        io.adv = in.advantages.data_ptr<A>();
        io.weights = in.weights.data_ptr<A>();
        io.w_ent = ptr_or_null<A>(in.entropy_weights);
        io.is_w = ptr_or_null<A>(in.rollout_is_weights);
        io.ref_logp = ptr_or_null<A>(in.ref_logprobs);
        io.params = params;
        io.logp = logp.data_ptr<A>();
        io.entropy = ent.data_ptr<A>();
        io.loss_tok = loss_tok.data_ptr<A>();
        io.grad_scale = static_cast<A>(params[ppo::slot::grad_scale]);
        run_rows<scalar_t>(rv, io, make_row_temp<A>(r), acc_opts, device, stream);
        weighted_sum_kernel<A><<<1, kMaxThreads, 0, stream>>>(
            in.weights.data_ptr<A>(), loss_tok.data_ptr<A>(), B * T, loss.data_ptr<A>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {loss, loss_tok, logp, ent, dlogits};
}

// Boxed kernels (csrc/loss_args.h: the arguments read by schema name).
void ppo_loss_fwd_cuda(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const ppo::OpArgs args(op, stack);
  auto [loss, loss_tok, logp, ent, dlogits] =
      ppo_loss_impl(args, args["compute_grad"].toBool(), false);
  args.ret(stack, loss, loss_tok, logp, ent, dlogits);
}

void ppo_loss_fwd_inplace_cuda(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const ppo::OpArgs args(op, stack);
  auto [loss, loss_tok, logp, ent, unused] = ppo_loss_impl(args, true, true);
  (void)unused;
  args.ret(stack, loss, loss_tok, logp, ent);
}

}  // namespace
}  // namespace ppo_cuda

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) {
  m.impl("ppo_loss_fwd",
         torch::CppFunction::makeFromBoxedFunction<&ppo_cuda::ppo_loss_fwd_cuda>());
  m.impl("ppo_loss_fwd_inplace",
         torch::CppFunction::makeFromBoxedFunction<&ppo_cuda::ppo_loss_fwd_inplace_cuda>());
}
