#pragma once
// Synthetic model files (model/synthetic_model.hpp) for the tests that run a
// real forward pass on a shape that has no file here (tiny-gemma3, ...).
#include <string>

#include "qkvshare/model/synthetic_model.hpp"
#include "test_paths.hpp"

namespace qkvshare::testing {

// Writes the named shape in `type` to a fresh temp folder (removed at exit) and returns its path.
inline std::string synthetic_file(const std::string& shape, GgmlType type) {
  const std::string path = temp_dir() + "/" + shape + "-" + std::string(type_name(type)) + ".gguf";
  SyntheticOptions opt;
  opt.type = type;
  opt.n_threads = 2;
  write_synthetic_model(find_synthetic_shape(shape), opt, path);
  return path;
}

}  // namespace qkvshare::testing
