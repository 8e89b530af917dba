// qkvshare._core: the extension module. Errors: every qkvshare::Error becomes
// a Python exception of a class per ErrorCode, all subclasses of
// qkvshare.Error, carrying `.code` (the ErrorCode enumerator's name, e.g. 'bad_descriptor') and the library's
// message; the classes also derive from the matching built-in exception
// (ValueError, OSError, MemoryError) so generic handlers catch them.
#include <nanobind/nanobind.h>

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

}  // namespace

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
