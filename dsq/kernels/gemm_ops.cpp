/* The GEMM kernels of gemm_cpu.c as torch custom ops, dsq::to_bf16, dsq::split_bf16 and
 * dsq::gemm_bf16 (dsq/kernels/onednn.py builds this file, linked against the installed oneDNN).
 *
 * As in bfp_ops.cpp: gemm_cpu.c compiled as C++ with C linkage, each op checking its tensors at
 * the boundary (a one-line ValueError naming the problem) and allocating its outputs, registered
 * under CompositeExplicitAutograd, with its fake kernel in Python (onednn.py).
 */
extern "C" {
#include "gemm_cpu.c"
}

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "op_checks.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

using dsq_ops::need;

/* A bf16 tensor of `shape` (each side at least x's [b, r, c]) laid out in x's memory order, so
 * that both are read and written in that order, with the region that x fills. */
struct Padded {
    Tensor padded, region;
};

/* The order of x's dimensions in memory, outermost first. */
std::vector<int64_t> memory_order(const Tensor &x) {
    std::vector<int64_t> order = {0, 1, 2};
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
    return order;
}

Padded padded_like(const char *op, const Tensor &x, at::IntArrayRef shape) {
    need(op, x, at::kFloat, 3);
    TORCH_CHECK_VALUE(shape.size() == 3 && shape[0] >= x.size(0) && shape[1] >= x.size(1) &&
                      shape[2] >= x.size(2), "dsq::", op, ": a padded shape ", shape,
                      " smaller than ", x.sizes());
    const std::vector<int64_t> order = memory_order(x);
    std::vector<int64_t> sizes, inverse(3);
    for (int64_t d = 0; d < 3; d++) {
        sizes.push_back(shape[order[d]]);
        inverse[order[d]] = d;
    }
    Tensor padded = at::empty(sizes, at::dtype(at::kBFloat16)).permute(inverse);
    Tensor region = padded.narrow(0, 0, x.size(0)).narrow(1, 0, x.size(1)).narrow(2, 0, x.size(2));
    return {padded, region};
}

/* Zero what lies outside x's region: a padded reduction must add nothing. */
void zero_padding(Tensor &padded, const Tensor &x, at::IntArrayRef shape) {
    for (int64_t d = 0; d < 3; d++)
        if (shape[d] > x.size(d)) padded.narrow(d, x.size(d), shape[d] - x.size(d)).zero_();
}

Tensor flag(int ok) { return at::empty({}, at::dtype(at::kBool)).fill_(ok != 0); }

/* (x [b, r, c] as bf16 inside a zero-padded tensor of `shape`, laid out in x's memory order; a
 * 0-D bool tensor: whether every value is a bf16 number the bf16 unit multiplies exactly,
 * gemm_cpu.c's fits_bf16). When one is not, the first tensor is unspecified and the caller runs
 * the float32 GEMM. */
std::tuple<Tensor, Tensor> to_bf16(const Tensor &x, at::IntArrayRef shape) {
    Padded out = padded_like("to_bf16", x, shape);
    const std::vector<int64_t> order = memory_order(x);
    Tensor src = x.permute(order), dst = out.region.permute(order);
    int ok = dsq_to_bf16(src.const_data_ptr<float>(), src.stride(0), src.stride(1),
                         src.stride(2), static_cast<uint16_t *>(dst.mutable_data_ptr()),
                         dst.stride(0), dst.stride(1), dst.stride(2), src.size(0), src.size(1),
                         src.size(2));
    if (ok) zero_padding(out.padded, x, shape);
    return {out.padded, flag(ok)};
}

/* (hi, lo, ok): x [b, r, c] as an exact pair hi + lo of bf16 numbers, each inside a zero-padded
 * tensor of `shape` laid out as to_bf16's; ok as to_bf16's, for both parts (gemm_cpu.c's
 * dsq_split_bf16: x's values of at most 16 significant bits). */
std::tuple<Tensor, Tensor, Tensor> split_bf16(const Tensor &x, at::IntArrayRef shape) {
    Padded hi = padded_like("split_bf16", x, shape), lo = padded_like("split_bf16", x, shape);
    const std::vector<int64_t> order = memory_order(x);
    Tensor src = x.permute(order), high = hi.region.permute(order), low = lo.region.permute(order);
    int ok = dsq_split_bf16(src.const_data_ptr<float>(), src.stride(0), src.stride(1),
                            src.stride(2), static_cast<uint16_t *>(high.mutable_data_ptr()),
                            static_cast<uint16_t *>(low.mutable_data_ptr()), high.stride(0),
                            high.stride(1), high.stride(2), src.size(0), src.size(1),
                            src.size(2));
    if (ok) {
        zero_padding(hi.padded, x, shape);
        zero_padding(lo.padded, x, shape);
    }
    return {hi.padded, lo.padded, flag(ok)};
}

/* a @ b (+ bias) as a new contiguous float32 tensor from bf16 a [batch, m, k] and b [batch, k, n]
 * of any strides; bias [n] float32 only with batch 1. */
Tensor gemm_bf16(const Tensor &a, const Tensor &b, const std::optional<Tensor> &bias_in) {
    need("gemm_bf16", a, at::kBFloat16, 3);
    need("gemm_bf16", b, at::kBFloat16, 3);
    TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(2) == b.size(1), "dsq::gemm_bf16 cannot "
                      "multiply ", a.sizes(), " by ", b.sizes());
    const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
    Tensor bias;
    if (bias_in.has_value()) {
        need("gemm_bf16", *bias_in, at::kFloat, 1);
        TORCH_CHECK_VALUE(batch == 1 && bias_in->size(0) == n, "dsq::gemm_bf16: a bias is [n] "
                          "float32, for an unbatched GEMM");
        bias = bias_in->contiguous();
    }
    Tensor out = at::empty({batch, m, n}, at::dtype(at::kFloat));
    if (out.numel() == 0) return out;
    if (k == 0)  // nothing to sum: oneDNN refuses an empty reduction
        return bias.defined() ? out.copy_(bias.expand_as(out)) : out.zero_();
    int status = dsq_gemm_bf16(
        static_cast<const uint16_t *>(a.const_data_ptr()),
        static_cast<const uint16_t *>(b.const_data_ptr()), out.mutable_data_ptr<float>(),
        bias.defined() ? bias.const_data_ptr<float>() : nullptr, batch, m, n, k, a.stride(0),
        a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2), 0);
    static const char *why[] = {"", "no CPU engine", "the shape was refused",
                                "the execution failed"};
    TORCH_CHECK(status == 0, "dsq::gemm_bf16 ", a.sizes(), " @ ", b.sizes(), ": oneDNN says ",
                status >= 1 && status <= 3 ? why[status] : "an unknown status");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsq, m) {
    m.def("to_bf16(Tensor x, int[] shape) -> (Tensor, Tensor)");
    m.def("split_bf16(Tensor x, int[] shape) -> (Tensor, Tensor, Tensor)");
    m.def("gemm_bf16(Tensor a, Tensor b, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsq, CompositeExplicitAutograd, m) {
    m.impl("to_bf16", &to_bf16);
    m.impl("split_bf16", &split_bf16);
    m.impl("gemm_bf16", &gemm_bf16);
}
