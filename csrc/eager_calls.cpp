// The eager per-call paths of the compiled ops, in C++ for their host cost alone (the
// arithmetic is the ops', the same bits): a Python autograd Function or a Python op call
// with a dozen arguments costs tens of microseconds, which is most of a small call.
//
// fused_loss: the eager autograd of the fused single pass (ppo_loss_fwd) as a C++ autograd
// Function, for the cpu and cuda backends. It does what the Python Function
// _autograd.FusedLoss does (the Triton ops and the in-place variant keep that one): the
// forward calls the op below autograd with compute_grad and keeps dlogits, pre-scaled by
// grad_scale; the backward hands it out as _autograd.hand_out does (in place when the graph
// is freed, a fresh copy when it is retained, nothing for a grad_output equal to the
// applied scale). torch.compile and torch.jit.trace never see it: they record the op
// itself, with the autograd formula registered in ppo_kernels/_autograd.py.
//
// metrics_dict: ppo_loss's metrics dict from the one op ppo_loss_metrics (the cpu backend),
// its [K] vector handed out as K 0-d tensors by name.
//
// tis_weights: rollout_correction="tis"'s weights on the valid positions,
// clamp(exp(clamp(old - rollout, -c, c)), lo, hi): ppo_kernels/rollout_correction.py's four
// element-wise ops (the formula lives there; these are the same ATen ops, so the same bits),
// called from C++ at ~1 us each instead of ~4 us from Python.
// (torch/csrc/utils/pybind.h, not torch/extension.h: the tensor casters without the whole
// C++ frontend, half this file's compile time)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sub.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/utils/pybind.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using ScaleSig = void(at::Tensor&, const at::Tensor&, at::Tensor&);

const c10::OperatorHandle& fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("ppo_kernels::ppo_loss_fwd", "");
  return op;
}

// The stack of one ppo_loss_fwd call with compute_grad, in its schema's order (csrc/ops.cpp):
// the logits, the per-token tensors, scalars, codes, compute_grad, the per-row tensors
// (the temperatures first), and the defaults of the arguments after those given. The
// schema is the one list of the arguments: a per-row tensor appended there with a default
// needs nothing here.
torch::jit::Stack fwd_stack(const at::Tensor& logits, const std::vector<OptTensor>& tensors,
                            const std::vector<double>& scalars,
                            const std::vector<int64_t>& codes,
                            const std::vector<OptTensor>& rows) {
  const std::vector<c10::Argument>& args = fwd_op().schema().arguments();
  const size_t at_scalars = 1 + tensors.size();
  TORCH_CHECK(args.size() >= at_scalars + 3 + rows.size() &&
                  args[at_scalars].name() == "scalars" &&
                  args[at_scalars + 2].name() == "compute_grad",
              "tensors / rows: expected the per-token tensors ppo_kernels::ppo_loss_fwd takes "
              "before its scalars and at most its per-row tensors after compute_grad, got ",
              tensors.size(), " and ", rows.size());
  torch::jit::Stack stack;
  stack.reserve(args.size());
  stack.emplace_back(logits);
  for (const OptTensor& t : tensors) stack.emplace_back(t);
  stack.emplace_back(scalars);
  stack.emplace_back(codes);
  stack.emplace_back(true);
  for (const OptTensor& t : rows) stack.emplace_back(t);
  for (size_t k = stack.size(); k < args.size(); ++k) {
    TORCH_CHECK(args[k].default_value().has_value(), "rows: ppo_kernels::ppo_loss_fwd's ",
                args[k].name(), " has no default and was not given");
    stack.push_back(*args[k].default_value());
  }
  return stack;
}

using MetricsSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const OptTensor&, const at::Tensor&, const OptTensor&,
                              const OptTensor&, const OptTensor&, c10::ArrayRef<double>,
                              c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>, const OptTensor&);

const c10::TypedOperatorHandle<MetricsSig>& metrics_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ppo_kernels::ppo_loss_metrics", "")
                             .typed<MetricsSig>();
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
constexpr size_t kNumArgs = 6;

struct FusedLossFn : public torch::autograd::Function<FusedLossFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const std::vector<OptTensor>& tensors,
                               const std::vector<double>& scalars,
                               const std::vector<int64_t>& codes,
                               const std::vector<OptTensor>& rows, int64_t grad_scale_slot) {
    TORCH_CHECK(grad_scale_slot >= 0 && size_t(grad_scale_slot) < scalars.size(),
                "grad_scale_slot: expected an index into scalars, got ", grad_scale_slot);
    torch::jit::Stack stack = fwd_stack(logits, tensors, scalars, codes, rows);
    {
      // straight to the device kernel: the op's autograd kernel (the Python formula) is
      // what this Function replaces
      at::AutoDispatchBelowADInplaceOrView below;
      fwd_op().callBoxed(&stack);
    }
    // (loss, loss_tok, logprobs, entropy, dlogits)
    const at::Tensor loss = stack[0].toTensor(), loss_tok = stack[1].toTensor(),
                     logp = stack[2].toTensor(), ent = stack[3].toTensor(),
                     dlogits = stack[4].toTensor();
    // the scale the saved gradient carries, rounded to the accumulation dtype as
    // _autograd.applied_scale's 0-d tensor is (made in the backward, where it is needed)
    const double scale = scalars[grad_scale_slot];
    ctx->saved_data["applied"] =
        logits.scalar_type() == at::kDouble ? scale : double(static_cast<float>(scale));
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
    const double applied = ctx->saved_data["applied"].toDouble();
    if (torch::autograd::get_current_graph_task_keep_graph()) {
      // a later backward of this graph reads it again: this one gives its own copy
      buf = buf.clone();
    }
    const auto acc = buf.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor g = grad.detach();
    if (g.scalar_type() != acc) g = g.to(acc);
    if (g.dim() != 0) g = g.reshape({});
    if (g.is_cpu() && g.layout() == at::kStrided) {
      // host memory: scale_grad_'s "nothing when grad_output equals the applied scale"
      // decided here, without its dispatch (the usual loss.backward())
      const double go = acc == at::kDouble ? *g.const_data_ptr<double>()
                                           : double(*g.const_data_ptr<float>());
      if (go == applied) {
        out[0] = buf;
        return out;
      }
    }
    at::Tensor ap = at::full({}, applied, g.options());
    scale_op().call(buf, g, ap);
    out[0] = buf;
    return out;
  }
};

}  // namespace

void init_eager_calls(pybind11::module_& m) {
  m.def(
      "fused_loss",
      [](const at::Tensor& logits, const std::vector<OptTensor>& tensors,
         const std::vector<double>& scalars, const std::vector<int64_t>& codes,
         const std::vector<OptTensor>& rows, int64_t grad_scale_slot) {
        variable_list out =
            FusedLossFn::apply(logits, tensors, scalars, codes, rows, grad_scale_slot);
        return std::make_tuple(out[0], out[1], out[2], out[3]);
      },
      "(loss, loss_tok, logprobs, entropy) of ppo_kernels::ppo_loss_fwd with its gradient "
      "in the autograd graph (the eager cpu / cuda path of ppo_loss): the logits, the op's "
      "per-token tensors before its scalars (a list in the schema's order, None for an "
      "absent one), scalars, codes, its per-row tensors after compute_grad (a list, as "
      "many as given), then the index of grad_scale in scalars.",
      pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def(
      "metrics_dict",
      [](const std::vector<std::string>& names, const at::Tensor& logp, const at::Tensor& ent,
         const at::Tensor& mask, const OptTensor& old, const at::Tensor& adv,
         const OptTensor& ref, const OptTensor& rollout, const OptTensor& rollout_w,
         const std::vector<double>& scalars, const std::vector<int64_t>& codes,
         const std::vector<int64_t>& slots, const OptTensor& kl_logprobs) {
        TORCH_CHECK(names.size() == slots.size(), "names: expected one per slot, got ",
                    names.size(), " names and ", slots.size(), " slots");
        std::vector<at::Tensor> values;
        {
          pybind11::gil_scoped_release no_gil;
          values = metrics_op()
                       .call(logp, ent, mask, old, adv, ref, rollout, rollout_w, scalars, codes,
                             slots, kl_logprobs)
                       .unbind();
        }
        pybind11::dict out;
        for (size_t k = 0; k < names.size(); ++k) out[pybind11::str(names[k])] = values[k];
        return out;
      },
      "{name: 0-d float32 tensor} from ppo_kernels::ppo_loss_metrics (its arguments after "
      "the names, one name per slot, in the slots' order).");
  m.def(
      "tis_weights",
      [](const at::Tensor& old, const at::Tensor& rollout, double clamp, double lo, double hi) {
        at::NoGradGuard no_grad;
        return at::clamp(at::exp(at::clamp(at::sub(old, rollout), -clamp, clamp)), lo, hi);
      },
      "clamp(exp(clamp(old - rollout, -clamp, clamp)), lo, hi) without autograd "
      "(rollout_correction.weights' tis on the valid positions).",
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
