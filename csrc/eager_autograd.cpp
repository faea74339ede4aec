// ppo_kernels._C.fused_loss: the eager autograd of the fused single pass (ppo_loss_fwd) as a
// C++ autograd Function, for the cpu and cuda backends. It does what the Python Function
// _autograd.FusedLoss does (the Triton ops and the in-place variant keep that one): the
// forward calls the op below autograd with compute_grad and keeps dlogits, pre-scaled by
// grad_scale; the backward hands it out as _autograd.hand_out does (in place when the graph
// is freed, a fresh copy when it is retained, nothing for a grad_output equal to the
// applied scale). Written in C++ for the per-call cost alone: a Python autograd Function
// costs tens of microseconds of interpreter time per forward and per backward, which is
// most of a small call (the arithmetic is the op's, the same bits).
//
// torch.compile and torch.jit.trace never see this function: they record the op itself,
// with the autograd formula registered in ppo_kernels/_autograd.py.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/extension.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using FwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, c10::ArrayRef<double>, c10::ArrayRef<int64_t>, bool, const OptTensor&);
using ScaleSig = void(at::Tensor&, const at::Tensor&, at::Tensor&);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ppo_kernels::ppo_loss_fwd", "")
                             .typed<FwdSig>();
  return op;
}

const c10::TypedOperatorHandle<ScaleSig>& scale_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ppo_kernels::scale_grad_", "")
                             .typed<ScaleSig>();
  return op;
}

// the number of arguments of FusedLossFn::forward after ctx: backward returns one gradient
// for each (undefined but for the logits)
constexpr size_t kNumArgs = 13;

struct FusedLossFn : public torch::autograd::Function<FusedLossFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const at::Tensor& tokens, const at::Tensor& mask,
                               const OptTensor& old, const at::Tensor& adv,
                               const at::Tensor& weights, const OptTensor& ref,
                               const OptTensor& isw, const OptTensor& w_ent,
                               const std::vector<double>& scalars,
                               const std::vector<int64_t>& codes, const OptTensor& temperatures,
                               int64_t grad_scale_slot) {
    TORCH_CHECK(grad_scale_slot >= 0 && size_t(grad_scale_slot) < scalars.size(),
                "grad_scale_slot: expected an index into scalars, got ", grad_scale_slot);
    at::Tensor loss, loss_tok, logp, ent, dlogits;
    {
      // straight to the device kernel: the op's autograd kernel (the Python formula) is
      // what this Function replaces
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(loss, loss_tok, logp, ent, dlogits) =
          fwd_op().call(logits, tokens, mask, old, adv, weights, ref, isw, w_ent, scalars,
                        codes, true, temperatures);
    }
    // the scale the saved gradient carries, as the 0-d tensor of the accumulation dtype
    // that scale_grad_ compares with grad_output on the device (_autograd.applied_scale)
    const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    ctx->saved_data["applied"] =
        at::full({}, scalars[grad_scale_slot], logits.options().dtype(acc));
    ctx->save_for_backward({dlogits});
    ctx->set_materialize_grads(false);
    ctx->mark_non_differentiable({loss_tok, logp, ent});
    return {loss, loss_tok, logp, ent};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(kNumArgs);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    // (the engine enables grad mode in a backward only for create_graph=True:
    // _autograd.first_order_only)
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "ppo_kernels: ppo_loss is differentiable once; a second derivative "
                "(create_graph=True, torch.autograd.functional.hessian, gradient penalties) "
                "is not supported on the kernel backends: use backend='torch' for it");
    at::Tensor buf = ctx->get_saved_variables()[0];
    at::Tensor applied = ctx->saved_data["applied"].toTensor();
    if (torch::autograd::get_current_graph_task_keep_graph()) {
      // a later backward of this graph reads them again: this one gives its own copy
      buf = buf.clone();
      applied = applied.clone();
    }
    at::Tensor g = grad.detach();
    if (g.scalar_type() != applied.scalar_type()) g = g.to(applied.scalar_type());
    if (g.dim() != 0) g = g.reshape({});
    scale_op().call(buf, g, applied);
    out[0] = buf;
    return out;
  }
};

}  // namespace

void init_eager_autograd(pybind11::module_& m) {
  m.def(
      "fused_loss",
      [](const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
         const OptTensor& old, const at::Tensor& adv, const at::Tensor& weights,
         const OptTensor& ref, const OptTensor& isw, const OptTensor& w_ent,
         const std::vector<double>& scalars, const std::vector<int64_t>& codes,
         const OptTensor& temperatures, int64_t grad_scale_slot) {
        variable_list out = FusedLossFn::apply(logits, tokens, mask, old, adv, weights, ref,
                                               isw, w_ent, scalars, codes, temperatures,
                                               grad_scale_slot);
        return std::make_tuple(out[0], out[1], out[2], out[3]);
      },
      "(loss, loss_tok, logprobs, entropy) of ppo_kernels::ppo_loss_fwd with its gradient "
      "in the autograd graph (the eager cpu / cuda path of ppo_loss; arguments as the op's, "
      "without compute_grad, then the index of grad_scale in scalars).",
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
