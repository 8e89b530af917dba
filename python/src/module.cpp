// qkvshare._core: the extension module. Errors: every qkvshare::Error becomes
// a Python exception of a class per ErrorCode, all subclasses of
// qkvshare.Error, carrying `.code` (the ErrorCode enumerator's name, e.g. 'bad_descriptor') and the library's
// message; the classes also derive from the matching built-in exception
// (ValueError, OSError, MemoryError) so generic handlers catch them.
#include <nanobind/nanobind.h>

#include <climits>

#include "py_common.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare::py {

namespace {

struct ErrorClass {
  ErrorCode code;
  const char* name;
  PyObject* builtin;  // an extra base, or nullptr
  const char* code_name;  // the ErrorCode enumerator, for `.code`
};

PyObject* g_error = nullptr;
constexpr int kCodes = static_cast<int>(ErrorCode::internal) + 1;
PyObject* g_classes[kCodes] = {};
const char* g_code_names[kCodes] = {};

// The value as a Python int: an int, or anything with __index__ (as
// nanobind's own int arguments take), else TypeError.
nb::object as_index(const IntArg& v, std::string_view name) {
  PyObject* i = PyNumber_Index(v.value.ptr());
  if (i == nullptr) {
    PyErr_Clear();
    throw nb::type_error(fmt::format("{} must be an int, got {}", name, nb::type_name(v.value.type()).c_str()).c_str());
  }
  return nb::steal(i);
}

std::string int_text(const nb::object& i) { return nb::str(i).c_str(); }

}  // namespace

int int_value(const IntArg& v, std::string_view name) {
  const nb::object i = as_index(v, name);
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0 || x < INT_MIN || x > INT_MAX)
    fail(ErrorCode::invalid_argument, "{} {} is out of range (a 32-bit int, [{}, {}])", name, int_text(i), INT_MIN,
         INT_MAX);
  return static_cast<int>(x);
}

std::uint64_t u64_value(const IntArg& v, std::string_view name) {
  const nb::object i = as_index(v, name);
  const unsigned long long x = PyLong_AsUnsignedLongLong(i.ptr());
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    fail(ErrorCode::invalid_argument, "{} {} is out of range (a 64-bit unsigned int, [0, 2**64))", name, int_text(i));
  }
  return x;
}

int threads_value(const IntArg& v, std::string_view name) {
  const nb::object i = as_index(v, name);
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && x < 0))
    fail(ErrorCode::invalid_argument, "{} must be >= 0, got {}", name, int_text(i));
  // More threads than any machine has cores only exhausts the process's
  // threads (or the host's pids) before the engine could start.
  if (overflow > 0 || x > kMaxThreads)
    fail(ErrorCode::invalid_argument, "{} must be <= {} (0: all hardware threads), got {}", name, kMaxThreads,
         int_text(i));
  return static_cast<int>(x);
}

std::string text_value(nb::handle v, std::string_view name) {
  if (!nb::isinstance<nb::str>(v))
    throw nb::type_error(fmt::format("{} must be a str, got {}", name, nb::type_name(v.type()).c_str()).c_str());
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(v.ptr(), &n);
  if (p == nullptr) {
    PyErr_Clear();
    fail(ErrorCode::invalid_argument, "{} cannot be encoded as UTF-8 (it holds a lone surrogate)", name);
  }
  return std::string(p, static_cast<std::size_t>(n));
}

void check_path(const std::string& path, std::string_view name) {
  if (path.find('\0') != std::string::npos)
    fail(ErrorCode::invalid_argument, "{}: path contains a NUL character", name);
}

void register_errors(nb::module_& m) {
  g_error = PyErr_NewExceptionWithDoc("qkvshare.Error",
                                      "Base of every qkvshare error; `.code` names the library's ErrorCode.",
                                      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(g_error);
  const ErrorClass classes[] = {
      {ErrorCode::invalid_argument, "InvalidArgument", PyExc_ValueError, "invalid_argument"},
      {ErrorCode::bad_model_file, "BadModelFile", nullptr, "bad_model_file"},
      {ErrorCode::bad_tokenizer, "BadTokenizer", nullptr, "bad_tokenizer"},
      {ErrorCode::unsupported, "Unsupported", nullptr, "unsupported"},
      {ErrorCode::io, "IOFailure", PyExc_OSError, "io"},
      {ErrorCode::context_full, "ContextFull", nullptr, "context_full"},
      {ErrorCode::out_of_memory, "OutOfMemory", PyExc_MemoryError, "out_of_memory"},
      {ErrorCode::bad_descriptor, "BadDescriptor", nullptr, "bad_descriptor"},
      {ErrorCode::bad_workflow, "BadWorkflow", nullptr, "bad_workflow"},
      {ErrorCode::internal, "InternalError", nullptr, "internal"},
  };
  for (const ErrorClass& c : classes) {
    PyObject* bases = c.builtin ? PyTuple_Pack(2, g_error, c.builtin) : PyTuple_Pack(1, g_error);
    const std::string qualified = std::string("qkvshare.") + c.name;
    PyObject* cls = PyErr_NewException(qualified.c_str(), bases, nullptr);
    Py_DECREF(bases);
    if (cls == nullptr) throw nb::python_error();
    g_classes[static_cast<int>(c.code)] = cls;
    g_code_names[static_cast<int>(c.code)] = c.code_name;
    m.attr(c.name) = nb::handle(cls);
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* cls = g_classes[static_cast<int>(e.code())];
      nb::object inst = nb::steal(PyObject_CallOneArg(cls, nb::str(e.what()).ptr()));
      if (!inst.is_valid()) return;  // the call set its own exception
      inst.attr("code") = nb::str(g_code_names[static_cast<int>(e.code())]);
      PyErr_SetObject(cls, inst.ptr());
    }
  });
}

}  // namespace qkvshare::py

NB_MODULE(_core, m) {
  m.doc() = "QKVShare: one model for many agents, quantized KV contexts handed over as descriptors";
  m.attr("__version__") = QKVSHARE_VERSION;
  qkvshare::py::register_errors(m);
  qkvshare::py::bind_model(m);
  qkvshare::py::bind_session(m);
  qkvshare::py::bind_share(m);
  qkvshare::py::bind_agents(m);
}
