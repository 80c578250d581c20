/* The boundary check every dsq::* op makes of its tensors (bfp_ops.cpp, gemm_ops.cpp): dtype,
 * CPU device, strided layout and rank, refused with a one-line ValueError naming the op, what it
 * needs and what it got. The fake kernels in Python (cpu.py `need`) give the same message. */
#pragma once

#include <ATen/core/Tensor.h>

#include <sstream>
#include <string>

namespace dsq_ops {

/* "float16 on cuda:0" (the layout too when it is not strided): what a refused tensor is. */
inline std::string describe(const at::Tensor &t) {
    std::ostringstream s;
    s << c10::getDtypeNames(t.scalar_type()).first << " on " << t.device();
    if (t.layout() != at::kStrided) s << " (" << t.layout() << " layout)";
    return s.str();
}

/* t is a strided CPU tensor of `dtype` with `dim` dimensions (any, for dim < 0). */
inline void need(const char *op, const at::Tensor &t, at::ScalarType dtype, int64_t dim = -1) {
    TORCH_CHECK_VALUE(
        t.scalar_type() == dtype && t.device().is_cpu() && t.layout() == at::kStrided, "dsq::", op,
        " needs a ", c10::getDtypeNames(dtype).first, " CPU tensor, got ", describe(t));
    TORCH_CHECK_VALUE(dim < 0 || t.dim() == dim, "dsq::", op, " needs a ", dim,
                      "-D tensor, got shape ", t.sizes());
}

}  // namespace dsq_ops
