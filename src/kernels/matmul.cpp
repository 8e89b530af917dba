#include "qkvshare/kernels/matmul.hpp"

#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kernels/quant.hpp"

namespace qkvshare::kernels {

void dequantize_row(const TensorView& w, std::int64_t r, float* dst) {
  QKV_CHECK(r >= 0 && r < w.rows());
  dequantize_row_ref(w.type, w.row(r), dst, w.cols());
}

void matmul_ref(const TensorView& w, const float* x, std::int64_t n_tokens, float* y) {
  const std::int64_t rows = w.rows();
  const std::int64_t cols = w.cols();
  for (std::int64_t t = 0; t < n_tokens; ++t)
    for (std::int64_t r = 0; r < rows; ++r) y[t * rows + r] = dot_row_ref(w.type, w.row(r), x + t * cols, cols);
}

void matmul(ThreadPool& pool, const TensorView& w, const float* x, std::int64_t n_tokens, float* y) {
  const std::int64_t rows = w.rows();
  const std::int64_t cols = w.cols();
  // Each row is expanded once and reused for every token of the batch.
  pool.parallel_for(static_cast<std::size_t>(rows), 16, [&](std::size_t begin, std::size_t end, int) {
    thread_local std::vector<float> row;
    row.resize(static_cast<std::size_t>(cols));
    for (std::size_t r = begin; r < end; ++r) {
      dequantize_row_ref(w.type, w.row(static_cast<std::int64_t>(r)), row.data(), cols);
      for (std::int64_t t = 0; t < n_tokens; ++t)
        y[t * rows + static_cast<std::int64_t>(r)] = dot_f32(row.data(), x + t * cols, cols);
    }
  });
}

}  // namespace qkvshare::kernels
