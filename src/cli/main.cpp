// qkvshare: the command-line entry point. Every qkvshare::Error ends here as
// "error: <message>" on stderr and exit status 1; usage errors exit with 2.
#include <cstdio>
#include <exception>

#include "common.hpp"
#include "qkvshare/core/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"QKVShare: multi-agent LLM inference with shared, quantized KV caches"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "qkvshare 0.1.0");
  qkvshare::cli::register_generate(app);
  qkvshare::cli::register_inspect(app);
  qkvshare::cli::register_bench(app);
  qkvshare::cli::register_make_model(app);
  qkvshare::cli::register_context(app);
  qkvshare::cli::register_pool(app);
  qkvshare::cli::register_eval(app);
  qkvshare::cli::register_calibrate(app);
  qkvshare::cli::register_run(app);
  qkvshare::cli::register_splice_eval(app);
  qkvshare::cli::register_serve(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const qkvshare::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
