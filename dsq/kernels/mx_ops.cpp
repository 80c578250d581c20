/* The C kernels of mx_cpu.c as torch custom ops, dsq::mx_* and dsq::nvfp4_* (dsq/kernels/mx_cpu.py
 * builds this file; bfp_ops.cpp is the model: the same boundary checks, registration and
 * threading).
 *
 * Each op checks its tensors (dtype, CPU device, strided layout, rank, stream lengths) and its
 * integer arguments (an element type the kernels hold: a code of 4, 6 or 8 bits), raising a
 * one-line ValueError naming the op, makes its inputs contiguous and allocates its outputs. The
 * fake kernels that torch.compile traces with are in Python (mx_cpu.py).
 */
#define restrict __restrict__
extern "C" {
#include "mx_cpu.c"
}
#undef restrict

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "op_checks.h"

#include <tuple>

namespace {

using at::Tensor;
using dsq_ops::need;

Tensor floats(at::IntArrayRef shape) { return at::empty(shape, at::dtype(at::kFloat)); }
Tensor bytes(at::IntArrayRef shape) { return at::empty(shape, at::dtype(at::kByte)); }

void threaded() { dsq_mx_set_threads(at::get_num_threads()); }

/* An element type the kernels hold (mx_cpu.c's Element): codes of 4, 6 or 8 bits, at most 6
 * mantissa bits, a block of at least one. */
void need_element(const char *op, int64_t block, int64_t bits, int64_t man_bits) {
    TORCH_CHECK_VALUE(block >= 1, "dsq::", op, " needs block of at least 1, got ", block);
    TORCH_CHECK_VALUE(bits == 4 || bits == 6 || bits == 8, "dsq::", op,
                      " needs bits of 4, 6 or 8, got ", bits);
    TORCH_CHECK_VALUE(0 <= man_bits && man_bits <= 6, "dsq::", op, " needs man_bits of 0 to 6, got ",
                      man_bits);
}

int64_t stream_bytes(int64_t count, int64_t bits) { return (count * bits + 7) / 8; }

/* The values of MX(element, block) of rows x [rows, n] (blocks along the rows). */
Tensor mx_quantize(const Tensor &rows, int64_t block, int64_t bits, int64_t man_bits,
                   int64_t emin, int64_t emax, double max_normal, bool integer) {
    need("mx_quantize", rows, at::kFloat, 2);
    need_element("mx_quantize", block, bits, man_bits);
    const Tensor x = rows.contiguous();
    Tensor out = floats(x.sizes());
    threaded();
    dsq_mx_quantize(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.size(0),
                    x.size(1), block, (int)bits, (int)man_bits, (int)emin, (int)emax,
                    (float)max_normal, integer);
    return out;
}

/* (the element stream, the scale codes [rows * ceil(n / block)]) of rows x [rows, n]. */
std::tuple<Tensor, Tensor> mx_pack(const Tensor &rows, int64_t block, int64_t bits,
                                   int64_t man_bits, int64_t emin, int64_t emax,
                                   double max_normal, bool integer) {
    need("mx_pack", rows, at::kFloat, 2);
    need_element("mx_pack", block, bits, man_bits);
    const Tensor x = rows.contiguous();
    const int64_t count = x.numel(), per_row = (x.size(1) + block - 1) / block;
    Tensor scales = bytes({x.size(0) * per_row});
    Tensor stream = bytes({stream_bytes(count, bits)});
    threaded();
    if (bits == 8) { /* the codes are the stream */
        dsq_mx_codes(x.const_data_ptr<float>(), stream.mutable_data_ptr<uint8_t>(),
                     scales.mutable_data_ptr<uint8_t>(), x.size(0), x.size(1), block, (int)bits,
                     (int)man_bits, (int)emin, (int)emax, (float)max_normal, integer);
        return {stream, scales};
    }
    Tensor codes = bytes({count});
    dsq_mx_codes(x.const_data_ptr<float>(), codes.mutable_data_ptr<uint8_t>(),
                 scales.mutable_data_ptr<uint8_t>(), x.size(0), x.size(1), block, (int)bits,
                 (int)man_bits, (int)emin, (int)emax, (float)max_normal, integer);
    dsq_mx_pack_stream(codes.const_data_ptr<uint8_t>(), stream.mutable_data_ptr<uint8_t>(), count,
                       (int)bits);
    return {stream, scales};
}

/* Values [rows, n] of an MX stream and its scale codes; `table` [2^bits] float32 holds each
 * code's element value. */
Tensor mx_decode(const Tensor &stream, const Tensor &scales, const Tensor &table, int64_t rows,
                 int64_t n, int64_t block, int64_t bits) {
    need("mx_decode", stream, at::kByte);
    need("mx_decode", scales, at::kByte);
    need("mx_decode", table, at::kFloat, 1);
    need_element("mx_decode", block, bits, 0);
    TORCH_CHECK_VALUE(rows >= 0 && n >= 0, "dsq::mx_decode needs rows and n of at least 0");
    TORCH_CHECK_VALUE(table.numel() == (int64_t)1 << bits, "dsq::mx_decode needs a table of ",
                      (int64_t)1 << bits, " values, got ", table.numel());
    const int64_t per_row = (n + block - 1) / block;
    TORCH_CHECK_VALUE(stream.numel() >= stream_bytes(rows * n, bits), "dsq::mx_decode: a stream of ",
                      stream.numel(), " bytes holds fewer than ", rows * n, " codes");
    TORCH_CHECK_VALUE(scales.numel() >= rows * per_row, "dsq::mx_decode: ", scales.numel(),
                      " scales for ", rows * per_row, " blocks");
    const Tensor s = stream.contiguous(), c = scales.contiguous(), t = table.contiguous();
    Tensor out = floats({rows, n});
    threaded();
    dsq_mx_decode(s.const_data_ptr<uint8_t>(), c.const_data_ptr<uint8_t>(),
                  t.const_data_ptr<float>(), out.mutable_data_ptr<float>(), rows, n, block,
                  (int)bits);
    return out;
}

/* NVFP4's tensor scale s of x (any shape), as a float32 tensor of one element. */
Tensor nvfp4_scale(const Tensor &input) {
    need("nvfp4_scale", input, at::kFloat);
    const Tensor x = input.contiguous();
    Tensor s = floats({1});
    threaded();
    s.mutable_data_ptr<float>()[0] = dsq_nvfp4_tensor_scale(x.const_data_ptr<float>(), x.numel());
    return s;
}

float scale_value(const char *op, const Tensor &s) {
    need(op, s, at::kFloat, 1);
    TORCH_CHECK_VALUE(s.numel() == 1, "dsq::", op, " needs a tensor scale of one value, got ",
                      s.numel());
    return s.const_data_ptr<float>()[0];
}

/* NVFP4 values of rows x [rows, n] under the tensor scale s. */
Tensor nvfp4_quantize(const Tensor &rows, const Tensor &s) {
    need("nvfp4_quantize", rows, at::kFloat, 2);
    const float scale = scale_value("nvfp4_quantize", s);
    const Tensor x = rows.contiguous();
    Tensor out = floats(x.sizes());
    threaded();
    dsq_nvfp4_quantize(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.size(0),
                       x.size(1), scale);
    return out;
}

/* (the E2M1 stream, the E4M3 scale codes) of rows x [rows, n] under the tensor scale s. */
std::tuple<Tensor, Tensor> nvfp4_pack(const Tensor &rows, const Tensor &s) {
    need("nvfp4_pack", rows, at::kFloat, 2);
    const float scale = scale_value("nvfp4_pack", s);
    const Tensor x = rows.contiguous();
    const int64_t count = x.numel();
    Tensor codes = bytes({count}), scales = bytes({x.size(0) * ((x.size(1) + 15) / 16)});
    Tensor stream = bytes({stream_bytes(count, 4)});
    threaded();
    dsq_nvfp4_codes(x.const_data_ptr<float>(), codes.mutable_data_ptr<uint8_t>(),
                    scales.mutable_data_ptr<uint8_t>(), x.size(0), x.size(1), scale);
    dsq_mx_pack_stream(codes.const_data_ptr<uint8_t>(), stream.mutable_data_ptr<uint8_t>(), count,
                       4);
    return {stream, scales};
}

/* Values [rows, n] of an NVFP4 stream, its scale codes and tensor scale; e2m1 [16] and e4m3
 * [256] float32 hold the codes' values. */
Tensor nvfp4_decode(const Tensor &stream, const Tensor &scales, const Tensor &s,
                    const Tensor &e2m1, const Tensor &e4m3, int64_t rows, int64_t n) {
    need("nvfp4_decode", stream, at::kByte);
    need("nvfp4_decode", scales, at::kByte);
    need("nvfp4_decode", e2m1, at::kFloat, 1);
    need("nvfp4_decode", e4m3, at::kFloat, 1);
    const float scale = scale_value("nvfp4_decode", s);
    TORCH_CHECK_VALUE(rows >= 0 && n >= 0, "dsq::nvfp4_decode needs rows and n of at least 0");
    TORCH_CHECK_VALUE(e2m1.numel() == 16 && e4m3.numel() == 256,
                      "dsq::nvfp4_decode needs tables of 16 and 256 values");
    TORCH_CHECK_VALUE(stream.numel() >= stream_bytes(rows * n, 4), "dsq::nvfp4_decode: a stream of ",
                      stream.numel(), " bytes holds fewer than ", rows * n, " codes");
    TORCH_CHECK_VALUE(scales.numel() >= rows * ((n + 15) / 16), "dsq::nvfp4_decode: too few scales");
    const Tensor st = stream.contiguous(), sc = scales.contiguous();
    const Tensor t2 = e2m1.contiguous(), t8 = e4m3.contiguous();
    Tensor out = floats({rows, n});
    threaded();
    dsq_nvfp4_decode(st.const_data_ptr<uint8_t>(), sc.const_data_ptr<uint8_t>(),
                     t2.const_data_ptr<float>(), t8.const_data_ptr<float>(), scale,
                     out.mutable_data_ptr<float>(), rows, n);
    return out;
}

/* A side of the pair as the kernels take it: (nvfp4, block, bits, man_bits, emin, emax, integer). */
void need_side(const char *op, at::IntArrayRef side) {
    TORCH_CHECK_VALUE(side.size() == 7, "dsq::", op, " needs a side of 7 integers, got ",
                      side.size());
    TORCH_CHECK_VALUE(side[0] == 0 || (side[1] == 16 && side[2] == 4), "dsq::", op,
                      ": an NVFP4 side has blocks of 16 and 4-bit codes");
    need_element(op, side[1], side[2], side[3]);
}

/* For x [L, N, K] (K's stride 1, the others any): (the values of side q along K, [L, N, K]; the
 * stream of side p's codes along N in the order [L, K, N]; p's scale codes
 * [L * K * ceil(N / p block)]). */
std::tuple<Tensor, Tensor, Tensor> mx_quantize_and_pack(const Tensor &input, at::IntArrayRef q,
                                                        double q_max, double q_s,
                                                        at::IntArrayRef p, double p_max,
                                                        double p_s) {
    need("mx_quantize_and_pack", input, at::kFloat, 3);
    need_side("mx_quantize_and_pack", q);
    need_side("mx_quantize_and_pack", p);
    const Tensor x = input.stride(2) == 1 ? input : input.contiguous();
    const int64_t L = x.size(0), N = x.size(1), K = x.size(2), count = x.numel();
    Tensor values = floats({L, N, K});
    Tensor scales = bytes({L * K * ((N + p[1] - 1) / p[1])});
    Tensor stream = bytes({stream_bytes(count, p[2])});
    Tensor codes = p[2] == 8 ? stream : bytes({count});
    threaded();
    dsq_mx_quantize_and_pack(x.const_data_ptr<float>(), values.mutable_data_ptr<float>(),
                             codes.mutable_data_ptr<uint8_t>(), scales.mutable_data_ptr<uint8_t>(),
                             L, N, K, x.stride(0), x.stride(1), q.data(), (float)q_max, (float)q_s,
                             p.data(), (float)p_max, (float)p_s);
    if (p[2] != 8)
        dsq_mx_pack_stream(codes.const_data_ptr<uint8_t>(), stream.mutable_data_ptr<uint8_t>(),
                           count, (int)p[2]);
    return {values, stream, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsq, m) {
    m.def("mx_quantize(Tensor rows, int block, int bits, int man_bits, int emin, int emax,"
          " float max_normal, bool integer) -> Tensor");
    m.def("mx_pack(Tensor rows, int block, int bits, int man_bits, int emin, int emax,"
          " float max_normal, bool integer) -> (Tensor, Tensor)");
    m.def("mx_decode(Tensor stream, Tensor scales, Tensor table, int rows, int n, int block,"
          " int bits) -> Tensor");
    m.def("mx_quantize_and_pack(Tensor x, int[] q, float q_max, float q_s, int[] p,"
          " float p_max, float p_s) -> (Tensor, Tensor, Tensor)");
    m.def("nvfp4_scale(Tensor x) -> Tensor");
    m.def("nvfp4_quantize(Tensor rows, Tensor s) -> Tensor");
    m.def("nvfp4_pack(Tensor rows, Tensor s) -> (Tensor, Tensor)");
    m.def("nvfp4_decode(Tensor stream, Tensor scales, Tensor s, Tensor e2m1, Tensor e4m3,"
          " int rows, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsq, CompositeExplicitAutograd, m) {
    m.impl("mx_quantize", &mx_quantize);
    m.impl("mx_pack", &mx_pack);
    m.impl("mx_decode", &mx_decode);
    m.impl("mx_quantize_and_pack", &mx_quantize_and_pack);
    m.impl("nvfp4_scale", &nvfp4_scale);
    m.impl("nvfp4_quantize", &nvfp4_quantize);
    m.impl("nvfp4_pack", &nvfp4_pack);
    m.impl("nvfp4_decode", &nvfp4_decode);
}
