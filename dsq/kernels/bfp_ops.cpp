/* The C kernels of bfp_cpu.c as torch custom ops, dsq::* (dsq/kernels/cpu.py builds this file).
 *
 * bfp_cpu.c is compiled here as C++ (its `restrict` spelled as the compilers' __restrict__, its
 * functions kept with C linkage), so that one shared library holds the kernels and their
 * registration with torch's dispatcher. Each op checks its tensors at the boundary (dtype, CPU
 * device, strided layout, rank, stream lengths) and its integer arguments (the widths and block
 * lengths the kernels hold: `need_range`, `need_format`), raising a one-line ValueError naming
 * the op and the problem, lays its inputs out as the kernels state (contiguous, or K's stride 1
 * for quantize_and_pack) and allocates its outputs; the kernels then run on torch's thread count
 * (dsq_set_threads, read on every call: torch.set_num_threads takes effect at once).
 *
 * The kernels are registered under CompositeExplicitAutograd (every backend key): a tensor of
 * another device reaches the check below instead of the dispatcher's "could not run" listing.
 * A Meta kernel, the fake implementation that torch.compile traces with, is registered in
 * Python beside the wrappers (cpu.py), and refuses what these checks refuse.
 */
#define restrict __restrict__
extern "C" {
#include "bfp_cpu.c"
}
#undef restrict

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "op_checks.h"

#include <sstream>
#include <string>
#include <tuple>

namespace {

using at::Tensor;

using dsq_ops::need;

Tensor floats(at::IntArrayRef shape) { return at::empty(shape, at::dtype(at::kFloat)); }
Tensor bytes(at::IntArrayRef shape) { return at::empty(shape, at::dtype(at::kByte)); }

/* An integer argument in [low, high] (high < 0: no upper bound), as a one-line ValueError naming
 * the op, the argument and its value. The fake kernels (cpu.py `need_range`) say the same. */
void need_range(const char *op, const char *name, int64_t value, int64_t low, int64_t high = -1) {
    if (high < 0) {
        TORCH_CHECK_VALUE(value >= low, "dsq::", op, " needs ", name, " of at least ", low,
                          ", got ", value);
    } else {
        TORCH_CHECK_VALUE(low <= value && value <= high, "dsq::", op, " needs ", name, " of ",
                          low, " to ", high, ", got ", value);
    }
}

/* BFP(man_bits, exp_bits) (or fixed<man_bits>) with nearest rounding as the kernels hold it
 * (bfp_cpu.c's header): 2 <= man_bits <= most (23: the rounding needs |v| < 2^22; 8 for codes,
 * one byte each) and 1 <= exp_bits <= 8 (every block power a float32). */
void need_format(const char *op, const char *man_name, int64_t man_bits, const char *exp_name,
                 int64_t exp_bits, int64_t most = 23) {
    need_range(op, man_name, man_bits, 2, most);
    need_range(op, exp_name, exp_bits, 1, 8);
}

/* Tell the kernels torch's thread count for this call. */
void threaded() { dsq_set_threads(at::get_num_threads()); }

/* BFP(man_bits, exp_bits, B) of blocks [n_blocks, B]. */
Tensor bfp_quantize(const Tensor &blocks, int64_t man_bits, int64_t exp_bits) {
    need("bfp_quantize", blocks, at::kFloat, 2);
    need_format("bfp_quantize", "man_bits", man_bits, "exp_bits", exp_bits);
    const Tensor x = blocks.contiguous();
    Tensor out = floats(x.sizes());
    threaded();
    dsq_bfp_quantize(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.size(0),
                     x.size(1), (int)man_bits, (int)exp_bits);
    return out;
}

/* BFP(man_bits, exp_bits, block) of x [outer, n, inner] along its middle axis. */
Tensor bfp_quantize_columns(const Tensor &input, int64_t block, int64_t man_bits,
                            int64_t exp_bits) {
    need("bfp_quantize_columns", input, at::kFloat, 3);
    need_range("bfp_quantize_columns", "block", block, 1);
    need_format("bfp_quantize_columns", "man_bits", man_bits, "exp_bits", exp_bits);
    const Tensor x = input.contiguous();
    Tensor out = floats(x.sizes());
    threaded();
    int status = dsq_bfp_quantize_columns(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
                                          x.size(0), x.size(1), x.size(2), block, (int)man_bits,
                                          (int)exp_bits);
    TORCH_CHECK_WITH(OutOfMemoryError, status == 0, "dsq::bfp_quantize_columns: no scratch memory "
                     "for a tile of ", block, " x ", x.size(2));
    return out;
}

/* (mantissa codes [n_blocks, B], one byte each, exponent codes [n_blocks]) of BFP(man_bits <= 8,
 * exp_bits, B) of blocks [n_blocks, B]. */
std::tuple<Tensor, Tensor> bfp_codes(const Tensor &blocks, int64_t man_bits, int64_t exp_bits) {
    need("bfp_codes", blocks, at::kFloat, 2);
    need_format("bfp_codes", "man_bits", man_bits, "exp_bits", exp_bits, 8);  // codes: a byte
    const Tensor x = blocks.contiguous();
    Tensor codes = bytes(x.sizes()), exps = bytes({x.size(0)});
    threaded();
    dsq_bfp_codes(x.const_data_ptr<float>(), codes.mutable_data_ptr<uint8_t>(),
                  exps.mutable_data_ptr<uint8_t>(), x.size(0), x.size(1), (int)man_bits,
                  (int)exp_bits);
    return {codes, exps};
}

/* fixed<man_bits> of x (any shape): one block over the whole tensor. */
Tensor fixed_quantize(const Tensor &input, int64_t man_bits, int64_t exp_bits) {
    need("fixed_quantize", input, at::kFloat);
    need_format("fixed_quantize", "man_bits", man_bits, "exp_bits", exp_bits);
    const Tensor x = input.contiguous();
    Tensor out = floats(x.sizes());
    threaded();
    dsq_fixed_quantize(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.numel(),
                       (int)man_bits, (int)exp_bits);
    return out;
}

/* fixed<f_man> of x, and BFP(s_man, s_exp, s_block) of that in consecutive blocks. */
std::tuple<Tensor, Tensor> fixed_then_bfp(const Tensor &input, int64_t f_man, int64_t f_exp,
                                          int64_t s_man, int64_t s_exp, int64_t s_block) {
    need("fixed_then_bfp", input, at::kFloat);
    need_format("fixed_then_bfp", "f_man", f_man, "f_exp", f_exp);
    need_format("fixed_then_bfp", "s_man", s_man, "s_exp", s_exp);
    need_range("fixed_then_bfp", "s_block", s_block, 1);
    TORCH_CHECK_VALUE(input.numel() % s_block == 0, "dsq::fixed_then_bfp: ", input.numel(),
                      " values are not whole blocks of ", s_block);
    const Tensor x = input.contiguous();
    Tensor first = floats(x.sizes()), second = floats(x.sizes());
    threaded();
    dsq_fixed_then_bfp(x.const_data_ptr<float>(), first.mutable_data_ptr<float>(),
                       second.mutable_data_ptr<float>(), x.numel(), (int)f_man, (int)f_exp,
                       (int)s_man, (int)s_exp, s_block);
    return {first, second};
}

/* (values [L, N, K] of BFP(q_man, q_exp, q_block) along K, the stash of BFP(p_man, p_exp,
 * p_block) along N: its stream [L * K * N * p_man / 8] when `stream`, else one code per byte
 * [L, K, N], exponent codes [L, K, N / p_block]) of x [L, N, K], read in its own strides when
 * K's is 1. */
std::tuple<Tensor, Tensor, Tensor> bfp_quantize_and_pack(const Tensor &input, int64_t p_block,
                                                         int64_t q_man, int64_t q_exp,
                                                         int64_t q_block, int64_t p_man,
                                                         int64_t p_exp, bool stream) {
    need("bfp_quantize_and_pack", input, at::kFloat, 3);
    need_range("bfp_quantize_and_pack", "p_block", p_block, 1);
    need_range("bfp_quantize_and_pack", "q_block", q_block, 1);
    need_format("bfp_quantize_and_pack", "q_man", q_man, "q_exp", q_exp);
    need_format("bfp_quantize_and_pack", "p_man", p_man, "p_exp", p_exp, 8);  // codes: a byte
    const Tensor x = input.stride(2) == 1 ? input : input.contiguous();
    const int64_t L = x.size(0), N = x.size(1), K = x.size(2);
    TORCH_CHECK_VALUE(K % q_block == 0, "dsq::bfp_quantize_and_pack: rows of ", K,
                      " values are not whole blocks of ", q_block);
    TORCH_CHECK_VALUE(!stream || ((p_block * p_man) % 8 == 0 && (N * p_man) % 8 == 0),
                      "dsq::bfp_quantize_and_pack: blocks of ", p_block, " codes or rows of ", N,
                      " codes of ", p_man, " bits do not fill whole bytes");
    Tensor values = floats({L, N, K});
    Tensor out = stream ? bytes({L * K * N * p_man / 8}) : bytes({L, K, N});
    Tensor exps = bytes({L, K, (N + p_block - 1) / p_block});
    threaded();
    int status = dsq_bfp_quantize_and_pack(
        x.const_data_ptr<float>(), x.stride(0), x.stride(1), values.mutable_data_ptr<float>(),
        out.mutable_data_ptr<uint8_t>(), exps.mutable_data_ptr<uint8_t>(), L, N, p_block, K,
        (int)q_man, (int)q_exp, q_block, (int)p_man, (int)p_exp, stream ? 1 : 0);
    TORCH_CHECK_WITH(OutOfMemoryError, status == 0, "dsq::bfp_quantize_and_pack: no scratch "
                     "memory for a tile of ", p_block, " x ", K);
    return {values, out, exps};
}

/* The stream of codes (uint8, one code per byte, any shape read flat) at `width` <= 8 bits. */
Tensor pack_codes(const Tensor &input, int64_t width) {
    need("pack_codes", input, at::kByte);
    TORCH_CHECK_VALUE(1 <= width && width <= 8, "dsq::pack_codes needs a width of 1 to 8 bits, "
                      "got ", width);
    const Tensor codes = input.contiguous();
    Tensor stream = bytes({(codes.numel() * width + 7) / 8});
    threaded();
    dsq_pack_codes(codes.const_data_ptr<uint8_t>(), codes.numel(), (int)width,
                   stream.mutable_data_ptr<uint8_t>());
    return stream;
}

/* A stream (uint8) holds `count` codes of `width` bits: the C code trusts the lengths. */
void holds(const Tensor &stream, int64_t count, int64_t width) {
    TORCH_CHECK_VALUE(stream.numel() >= (count * width + 7) / 8, "dsq::bfp_decode: a stream of ",
                      stream.numel(), " bytes holds fewer than ", count, " codes of ", width,
                      " bits");
}

/* Values [rows, n] of BFP(man_bits <= 8, exp_bits, block) streams, the block axis last. */
Tensor bfp_decode(const Tensor &mantissas_in, const Tensor &exponents_in, int64_t rows, int64_t n,
                  int64_t block, int64_t man_bits, int64_t exp_bits) {
    need("bfp_decode", mantissas_in, at::kByte);
    need("bfp_decode", exponents_in, at::kByte);
    need_range("bfp_decode", "rows", rows, 0);
    need_range("bfp_decode", "n", n, 0);
    need_range("bfp_decode", "block", block, 1);
    need_format("bfp_decode", "man_bits", man_bits, "exp_bits", exp_bits, 8);  // codes: a byte
    holds(mantissas_in, rows * n, man_bits);
    holds(exponents_in, rows * ((n + block - 1) / block), exp_bits);
    const Tensor mantissas = mantissas_in.contiguous(), exponents = exponents_in.contiguous();
    Tensor out = floats({rows, n});
    threaded();
    int status = dsq_bfp_decode(mantissas.const_data_ptr<uint8_t>(), mantissas.numel(),
                                exponents.const_data_ptr<uint8_t>(), exponents.numel(),
                                out.mutable_data_ptr<float>(), rows, n, block, (int)man_bits,
                                (int)exp_bits);
    TORCH_CHECK_WITH(OutOfMemoryError, status == 0, "dsq::bfp_decode: no scratch memory for a "
                     "row of ", n, " codes");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsq, m) {
    m.def("bfp_quantize(Tensor blocks, int man_bits, int exp_bits) -> Tensor");
    m.def("bfp_quantize_columns(Tensor x, int block, int man_bits, int exp_bits) -> Tensor");
    m.def("bfp_codes(Tensor blocks, int man_bits, int exp_bits) -> (Tensor, Tensor)");
    m.def("fixed_quantize(Tensor x, int man_bits, int exp_bits) -> Tensor");
    m.def("fixed_then_bfp(Tensor x, int f_man, int f_exp, int s_man, int s_exp, int s_block)"
          " -> (Tensor, Tensor)");
    m.def("bfp_quantize_and_pack(Tensor x, int p_block, int q_man, int q_exp, int q_block,"
          " int p_man, int p_exp, bool stream) -> (Tensor, Tensor, Tensor)");
    m.def("pack_codes(Tensor codes, int width) -> Tensor");
    m.def("bfp_decode(Tensor mantissas, Tensor exponents, int rows, int n, int block,"
          " int man_bits, int exp_bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsq, CompositeExplicitAutograd, m) {
    m.impl("bfp_quantize", &bfp_quantize);
    m.impl("bfp_quantize_columns", &bfp_quantize_columns);
    m.impl("bfp_codes", &bfp_codes);
    m.impl("fixed_quantize", &fixed_quantize);
    m.impl("fixed_then_bfp", &fixed_then_bfp);
    m.impl("bfp_quantize_and_pack", &bfp_quantize_and_pack);
    m.impl("pack_codes", &pack_codes);
    m.impl("bfp_decode", &bfp_decode);
}
