#pragma once
// Dense f32 KV cache: the reference storage the quantized pool is checked
// against. K and V are [layer][token][kv_dim].
#include <vector>

#include "qkvshare/kv/kv_cache.hpp"

namespace qkvshare {

class DenseKvCache final : public KvCache {
 public:
  DenseKvCache(const KvShape& shape, int capacity);

  const KvShape& shape() const noexcept override { return shape_; }
  int size() const noexcept override { return size_; }
  int capacity() const noexcept override { return capacity_; }
  void write(int layer, int n, const float* k, const float* v) override;
  AttendWork& plan_attend(int layer, int n, const float* q, float* out, int window = 0) override;
  void commit(int n) override;

  const float* keys(int layer, int token) const;
  const float* values(int layer, int token) const;

 private:
  // One job per (query token, query head): the reference sequence of kernels::attend_head_f32.
  class Work final : public AttendWork {
   public:
    std::size_t jobs() const noexcept override;
    double job_cost() const noexcept override;
    void run(std::size_t job) override;
    void finish() override {}
    const DenseKvCache* cache = nullptr;
    int layer = 0, n = 0, window = 0;
    const float* q = nullptr;
    float* out = nullptr;
  };
  float* k_at(int layer, int token);
  float* v_at(int layer, int token);
  KvShape shape_;
  int capacity_;
  int size_ = 0;
  std::vector<float> k_;
  std::vector<float> v_;
  Work work_;
};

}  // namespace qkvshare
